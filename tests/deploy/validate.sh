#!/usr/bin/env bash
# Validates attnserve's deployment files offline, with no cluster and no Docker
# engine: the Dockerfile, every kustomize overlay under deploy/k8s/, the Grafana
# dashboard and the Prometheus alert rules. From the repository root:
#
#   bash tests/deploy/validate.sh            # every check; exit 1 on any failure
#   bash tests/deploy/validate.sh --update   # regenerate deploy/k8s/components/monitoring/prometheusrule.yaml
#
# Needs kubectl (with kustomize v5) or kustomize, node >= 18 with npm (the
# schema packages are pinned in tests/deploy/package-lock.json and installed
# with `npm ci`), yamllint and promtool. Prints one line per check and a final
# "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
root=$PWD
here=tests/deploy
rule_src=deploy/prometheus/alerts.yaml
rule_crd=deploy/k8s/components/monitoring/prometheusrule.yaml

# The Prometheus Operator's copy of the alert rules: alerts.yaml's groups under
# a PrometheusRule, so that the two cannot drift apart.
render_prometheusrule() {
  cat <<'EOF'
# GENERATED from deploy/prometheus/alerts.yaml by
# `bash tests/deploy/validate.sh --update`; edit alerts.yaml, not this file.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: attnserve
  labels:
    app.kubernetes.io/name: attnserve
    app.kubernetes.io/instance: attnserve
spec:
EOF
  # alerts.yaml without its leading comment, indented under spec.
  awk 'started || !/^(#|$)/ { started = 1; print }' "$rule_src" | sed -e 's/^\(.\)/  \1/'
}

if [[ "${1:-}" == "--update" ]]; then
  render_prometheusrule >"$rule_crd" && echo "wrote $rule_crd"
  exit $?
fi

passed=0
failed=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# check NAME CMD...: one check; CMD's output is shown only when it fails.
check() {
  local name=$1
  shift
  local out
  if out=$("$@" 2>&1); then
    passed=$((passed + 1))
    echo "ok   $name"
  else
    failed=$((failed + 1))
    echo "FAIL $name"
    [[ -n "$out" ]] && sed 's/^/     /' <<<"$out" | head -n 40
  fi
}

need() { command -v "$1" >/dev/null 2>&1 || { echo "$1 not found on PATH${2:+ ($2)}"; return 1; }; }

# ------------------------------------------------------------------ tools
# kubectl embeds kustomize; Debian 12's kubernetes-client (1.20, kustomize
# v2) is too old for this layout (components, patches, labels), so prefer a
# standalone kustomize when kubectl's is older than v5.
kustomize_cmd=()
pick_kustomize() {
  local v
  if command -v kubectl >/dev/null 2>&1; then
    v=$(kubectl version --client -o json 2>/dev/null | sed -n 's/.*"kustomizeVersion": *"v\{0,1\}\([0-9]*\).*/\1/p')
    if [[ -n "$v" && "$v" -ge 5 ]]; then kustomize_cmd=(kubectl kustomize); return 0; fi
  fi
  if command -v kustomize >/dev/null 2>&1; then kustomize_cmd=(kustomize build); return 0; fi
  echo "need kubectl >= 1.27 (kustomize v5) or kustomize on PATH; kubectl's kustomize is '${v:-absent}'"
  return 1
}
# Not through check: it sets kustomize_cmd, which a subshell would lose.
if why=$(pick_kustomize) && pick_kustomize >/dev/null; then
  passed=$((passed + 1))
  echo "ok   tools: kustomize v5 (${kustomize_cmd[*]})"
else
  failed=$((failed + 1))
  echo "FAIL tools: kustomize v5"
  echo "     $why"
fi
check "tools: node >= 18 and npm" bash -c 'command -v npm >/dev/null && node -e "process.exit(+process.versions.node.split(\".\")[0] >= 18 ? 0 : 1)" || { echo "need node >= 18 and npm"; exit 1; }'
check "tools: yamllint" need yamllint "apt-get install yamllint"
check "tools: promtool" need promtool "apt-get install prometheus"

# ------------------------------------------------------------------ npm ci
check "npm ci (pinned kubernetes-models, @kubernetes-models/prometheus-operator, yaml)" \
  npm ci --prefix "$here" --no-audit --no-fund --loglevel=error

# ------------------------------------------------------------------ kustomize
mkdir -p "$work/rendered"
render() { # render NAME DIR: a failed render leaves no file to check
  "${kustomize_cmd[@]}" "$2" >"$work/rendered/$1.yaml" || { rm -f "$work/rendered/$1.yaml"; return 1; }
}
# Each overlay as shipped, and each overlay with every optional component
# (auth, monitoring, TLS) turned on, so that the components are validated too.
components=()
for c in deploy/k8s/components/*/; do [[ -f "$c/kustomization.yaml" ]] && components+=("${c%/}"); done
for dir in deploy/k8s/overlays/*/; do
  name=$(basename "$dir")
  if ((${#kustomize_cmd[@]})); then
    check "kustomize: overlays/$name renders" render "$name" "$dir"
    # The components the overlay does not include already (a component
    # included twice would add its objects twice).
    extra=()
    for c in "${components[@]}"; do
      grep -Eq "^[[:space:]]*-[[:space:]]*(\.\./)+components/${c##*/}/?[[:space:]]*$" "$dir/kustomization.yaml" || extra+=("$c")
    done
    if ((${#extra[@]})); then
      # kustomize wants relative paths.
      tmp="$work/with-components-$name"
      mkdir -p "$tmp"
      {
        echo "apiVersion: kustomize.config.k8s.io/v1beta1"
        echo "kind: Kustomization"
        echo "resources:"
        echo "  - $(realpath --relative-to="$tmp" "$dir")"
        echo "components:"
        for c in "${extra[@]}"; do echo "  - $(realpath --relative-to="$tmp" "$c")"; done
      } >"$tmp/kustomization.yaml"
      check "kustomize: overlays/$name with components (${extra[*]##*/}) renders" \
        render "$name+components" "$work/with-components-$name"
    fi
  else
    check "kustomize: overlays/$name renders" false
  fi
done

# ------------------------------------------------------------------ yamllint
check "yamllint deploy/ (deploy/.yamllint, strict)" yamllint --strict -c deploy/.yamllint deploy/

# ------------------------------------------------------------------ promtool
check "promtool check rules $rule_src" promtool check rules "$rule_src"
check "promtool test rules deploy/prometheus/alerts_test.yaml" promtool test rules deploy/prometheus/alerts_test.yaml
render_prometheusrule >"$work/prometheusrule.yaml"
check "$rule_crd is alerts.yaml's groups (else run with --update)" \
  diff -u "$rule_crd" "$work/prometheusrule.yaml"

# ------------------------------------------------------------------ node checks
# Schemas, cross-object consistency, the Dockerfile, metric names. Each of its
# lines is one check.
if [[ -d "$here/node_modules/kubernetes-models" ]]; then
  node "$here/check.mjs" "$root" "$work/rendered" >"$work/node.out" 2>&1
  rc=$?
  grep -v '^#' "$work/node.out"
  n_ok=$(grep -c '^ok ' "$work/node.out")
  n_fail=$(grep -c '^FAIL ' "$work/node.out")
  passed=$((passed + n_ok))
  failed=$((failed + n_fail))
  if ((rc != 0 && n_fail == 0)); then
    failed=$((failed + 1))
    echo "FAIL node $here/check.mjs exited $rc"
  fi
else
  check "schema and consistency checks (node_modules missing: npm ci failed)" false
fi

echo "$passed passed, $failed failed"
((failed == 0))
