// Offline checks of attnserve's deployment files, run by validate.sh:
//
//   node tests/deploy/check.mjs ROOT RENDERED_DIR
//
// ROOT is the repository; RENDERED_DIR holds one `kubectl kustomize` output per
// overlay (NAME.yaml). Prints one line per check, "ok   NAME" or "FAIL NAME"
// followed by indented reasons; validate.sh counts them.
//
//  - every rendered object against the Kubernetes 1.27 and prometheus-operator
//    schemas (kubernetes-models), plus a strict pass that rejects unknown fields
//    (the schemas themselves allow them, so a typo would pass silently);
//  - the objects of one overlay against each other, the server's flags
//    (server/flags.cc) and the image it runs (the Dockerfile's CUDA or CPU
//    target): ports, probes, selectors, the StatefulSet's headless Service,
//    spreading over nodes, drain time, security context, resources,
//    placeholder Secrets;
//  - the Dockerfile's two images against the build (CMakeLists.txt) and
//    .dockerignore;
//  - the metric names, labels and label values of the dashboard and the alert
//    rules against docs/design.md section 7 (and docs/operations.md, server/metrics.cc);
//    the dashboard may also use the families docs/operations.md documents
//    beyond the contract.
import fs from "node:fs";
import path from "node:path";
import { parseAllDocuments, parse as parseYaml } from "yaml";

const [root, renderedDir] = process.argv.slice(2);
if (!root || !renderedDir) {
  console.error("usage: node check.mjs ROOT RENDERED_DIR");
  process.exit(2);
}

// ------------------------------------------------------------------ reporting
let failures = 0;
// check(name, fn): fn returns a list of problems (empty: pass) or throws.
async function check(name, fn) {
  let problems;
  try {
    problems = await fn();
  } catch (e) {
    problems = [`exception: ${e && e.stack ? e.stack.split("\n").slice(0, 3).join(" | ") : e}`];
  }
  if (!problems || problems.length === 0) {
    console.log(`ok   ${name}`);
  } else {
    failures++;
    console.log(`FAIL ${name}`);
    for (const p of problems) console.log(`     ${p}`);
  }
}
const read = (rel) => fs.readFileSync(path.join(root, rel), "utf8");
const exists = (rel) => fs.existsSync(path.join(root, rel));

// ------------------------------------------------------------------ the server
// Flags the server defines (ABSL_FLAG in server/flags.cc) with their defaults.
function serverFlags() {
  const src = read("server/flags.cc");
  const flags = new Map();
  const re = /ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)\s*,\s*([^,]+?)\s*,/g;
  for (let m; (m = re.exec(src)); ) flags.set(m[1], m[2].replace(/^"|"$/g, ""));
  return flags;
}
const FLAGS = serverFlags();
// Flags Abseil itself handles.
const BUILTIN_FLAGS = new Set(["flagfile", "fromenv", "tryfromenv", "undefok", "help", "helpfull", "version"]);

// Executables CMakeLists.txt builds and installs.
function cmakeTargets() {
  const src = read("CMakeLists.txt");
  const built = new Set([...src.matchAll(/add_executable\(\s*([\w-]+)/g)].map((m) => m[1]));
  const installed = new Set();
  for (const m of src.matchAll(/install\(\s*TARGETS\s+([^)]*?)\s+RUNTIME\b/g)) {
    for (const t of m[1].split(/\s+/)) installed.add(t);
  }
  const version = (src.match(/project\(\s*\w+\s+VERSION\s+([\d.]+)/) || [])[1];
  return { built, installed, version };
}

// ------------------------------------------------------------------ Dockerfile
function parseDockerfile(text) {
  const lines = [];
  let cur = "";
  for (const raw of text.split("\n")) {
    if (/^\s*#/.test(raw) && cur === "") continue;
    if (/^\s*#/.test(raw)) continue; // comment inside a continuation
    if (/\\\s*$/.test(raw)) {
      cur += raw.replace(/\\\s*$/, " ");
      continue;
    }
    cur += raw;
    if (cur.trim()) lines.push(cur.trim());
    cur = "";
  }
  const globalArgs = {};
  const stages = [];
  for (const line of lines) {
    const m = line.match(/^(\w+)\s+([\s\S]*)$/);
    if (!m) continue;
    const instr = m[1].toUpperCase();
    const rest = m[2];
    if (instr === "FROM") {
      const f = rest.match(/^(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?/i);
      stages.push({ image: f[1], name: f[2] || String(stages.length), instrs: [], args: {} });
      continue;
    }
    if (instr === "ARG" && stages.length === 0) {
      const [k, v] = rest.split("=");
      globalArgs[k.trim()] = v === undefined ? "" : v.trim();
      continue;
    }
    if (stages.length === 0) continue;
    stages[stages.length - 1].instrs.push({ instr, rest });
  }
  const subst = (s) => s.replace(/\$\{?(\w+)\}?/g, (_, k) => (k in globalArgs ? globalArgs[k] : `\${${k}}`));
  for (const s of stages) s.image = subst(s.image);
  return { stages, globalArgs };
}

// JSON (exec) form or shell form of an instruction's arguments.
function argv(rest) {
  const t = rest.trim();
  if (t.startsWith("[")) return JSON.parse(t);
  return t.split(/\s+/);
}

// COPY/ADD sources in the build context, and RUN --mount=type=bind sources.
function contextSources(stage) {
  const out = [];
  for (const { instr, rest } of stage.instrs) {
    if (instr === "COPY" || instr === "ADD") {
      const words = rest.trim().startsWith("[") ? JSON.parse(rest) : rest.trim().split(/\s+/);
      const opts = words.filter((w) => w.startsWith("--"));
      const paths = words.filter((w) => !w.startsWith("--"));
      if (opts.some((o) => o.startsWith("--from="))) continue;
      out.push(...paths.slice(0, -1));
    } else if (instr === "RUN") {
      for (const m of rest.matchAll(/--mount=(\S+)/g)) {
        const kv = Object.fromEntries(m[1].split(",").map((p) => p.split("=")));
        if ((kv.type || "bind") === "bind" && !kv.from && kv.source) out.push(kv.source);
      }
    }
  }
  return out;
}

// .dockerignore semantics (the subset this repository uses): patterns in
// order, the last match wins, '!' re-includes; a pattern also matches every
// path below a matched directory.
function dockerIgnored(rel, patterns) {
  const toRe = (p) =>
    new RegExp(
      "^" +
        p
          .replace(/\/+$/, "")
          .replace(/[.+^${}()|[\]\\]/g, "\\$&")
          .replace(/\*\*\//g, "(?:.*/)?")
          .replace(/\*\*/g, ".*")
          .replace(/\*/g, "[^/]*")
          .replace(/\?/g, "[^/]") +
        "(?:/.*)?$",
    );
  let ignored = false;
  const clean = rel.replace(/^\.\//, "").replace(/\/+$/, "");
  for (const raw of patterns) {
    const neg = raw.startsWith("!");
    const p = (neg ? raw.slice(1) : raw).replace(/^\//, "");
    if (toRe(p).test(clean)) ignored = !neg;
  }
  return ignored;
}

function listenPort(args, flag) {
  for (const a of args) {
    const m = a.match(new RegExp(`^--${flag}=(.*)$`));
    if (m) {
      const port = m[1].match(/:(\d+)$/);
      return { addr: m[1], port: port ? Number(port[1]) : null };
    }
  }
  return null;
}

// The two images the Dockerfile builds, each a runtime stage fed by a builder
// stage: the CUDA image (the last stage, the default target) and the CPU image
// (`docker build --target runtime-cpu`, tagged ...-cpu; no CUDA in it).
const IMAGES = {
  cuda: { runtime: "runtime", builder: "builder", cuda: "ON" },
  cpu: { runtime: "runtime-cpu", builder: "builder-cpu", cuda: "OFF" },
};
// Which image a manifest's image reference names: a tag ending in -cpu is the
// CPU image.
const imageKind = (ref) => (/:[\w.-]*-cpu(@sha256:[0-9a-f]{64})?$/.test(ref) ? "cpu" : "cuda");

// What one runtime stage runs: entrypoint, health check, ports, user.
function stageFacts(df, runtime) {
  const last = (instr) => [...runtime.instrs].reverse().find((i) => i.instr === instr);
  const entry = last("ENTRYPOINT") ? argv(last("ENTRYPOINT").rest) : [];
  const health = last("HEALTHCHECK");
  let healthArgv = [];
  if (health) {
    const cmd = health.rest.match(/\bCMD\s+([\s\S]*)$/);
    if (cmd) healthArgv = argv(cmd[1]);
  }
  const expose = runtime.instrs
    .filter((i) => i.instr === "EXPOSE")
    .flatMap((i) => i.rest.split(/\s+/))
    .map((p) => Number(p.split("/")[0]));
  const user = last("USER") ? last("USER").rest.trim() : "";
  const grpc = listenPort(entry, "listen");
  const metrics = listenPort(entry, "metrics_listen");
  // The server's own defaults when the entrypoint does not set them.
  const dflt = (flag) => Number((FLAGS.get(flag) || "").split(":").pop());
  return {
    df,
    runtime,
    entry,
    healthArgv,
    expose,
    user,
    grpcPort: grpc ? grpc.port : dflt("listen"),
    grpcAddr: grpc ? grpc.addr : FLAGS.get("listen"),
    metricsPort: metrics ? metrics.port : dflt("metrics_listen"),
    metricsAddr: metrics ? metrics.addr : FLAGS.get("metrics_listen"),
  };
}

// Returns { cuda: facts, cpu: facts } for the stages that exist.
async function dockerfileChecks() {
  if (!exists("Dockerfile")) {
    await check("Dockerfile exists", () => ["no Dockerfile at the repository root"]);
    return null;
  }
  const df = parseDockerfile(read("Dockerfile"));
  const stage = (name) => df.stages.find((s) => s.name === name);
  const targets = cmakeTargets();
  const images = {};
  for (const [kind, names] of Object.entries(IMAGES)) {
    if (stage(names.runtime)) images[kind] = stageFacts(df, stage(names.runtime));
  }

  await check("Dockerfile: stages builder, runtime (the last: the default target), builder-cpu, runtime-cpu", () => {
    const p = [];
    for (const names of Object.values(IMAGES)) {
      for (const n of [names.builder, names.runtime]) if (!stage(n)) p.push(`no stage named ${n}`);
    }
    const lastStage = df.stages[df.stages.length - 1];
    if (lastStage && lastStage.name !== IMAGES.cuda.runtime) {
      p.push(`the last stage is ${lastStage.name}: \`docker build .\` would not build the CUDA image`);
    }
    return p;
  });

  await check("Dockerfile: the CUDA image builds on CUDA 13 devel and runs on the matching -base image (Ubuntu 24.04)", () => {
    const p = [];
    const b = stage(IMAGES.cuda.builder);
    const r = stage(IMAGES.cuda.runtime);
    if (!b || !r) return ["no CUDA builder or runtime stage"];
    const bm = b.image.match(/^nvidia\/cuda:(13\.\d+\.\d+)-devel-ubuntu(24\.04)$/);
    // cudart is linked statically and every other library is bundled in the
    // install tree, so the runtime needs no CUDA library beyond the driver.
    const rm = r.image.match(/^nvidia\/cuda:(13\.\d+\.\d+)-base-ubuntu(24\.04)$/);
    if (!bm) p.push(`${b.name} FROM ${b.image}: expected nvidia/cuda:13.x.y-devel-ubuntu24.04`);
    if (!rm) p.push(`${r.name} FROM ${r.image}: expected nvidia/cuda:13.x.y-base-ubuntu24.04`);
    if (bm && rm && bm[1] !== rm[1]) p.push(`CUDA versions differ: ${bm[1]} vs ${rm[1]}`);
    if (!/\bcudart_static\b/.test(read("CMakeLists.txt"))) {
      p.push("CMakeLists.txt no longer links CUDA::cudart_static: the -base image has no other CUDA libraries");
    }
    return p;
  });

  await check("Dockerfile: the CPU image builds on Debian 12 and runs on debian:12-slim, with no CUDA", () => {
    const p = [];
    const b = stage(IMAGES.cpu.builder);
    const r = stage(IMAGES.cpu.runtime);
    if (!b || !r) return ["no CPU builder or runtime stage"];
    // scripts/install_deps.sh and CI target Debian 12; the install tree
    // bundles the builder's libraries, so both stages are the same release.
    if (!/^debian:12(\.\d+)?$/.test(b.image)) p.push(`${b.name} FROM ${b.image}: expected debian:12`);
    if (!/^debian:12(\.\d+)?-slim$/.test(r.image)) p.push(`${r.name} FROM ${r.image}: expected debian:12-slim`);
    for (const s of [b, r]) if (/cuda/i.test(s.image)) p.push(`${s.name} FROM ${s.image}: a CUDA image`);
    return p;
  });

  await check("Dockerfile: COPY/mount sources exist and .dockerignore lets them in", () => {
    const p = [];
    const patterns = exists(".dockerignore")
      ? read(".dockerignore")
          .split("\n")
          .map((l) => l.trim())
          .filter((l) => l && !l.startsWith("#"))
      : [];
    for (const s of df.stages) {
      for (const src of contextSources(s)) {
        if (/[*?[]/.test(src)) {
          p.push(`${src}: wildcards are not checked; name the paths`);
          continue;
        }
        if (!exists(src)) p.push(`${s.name}: ${src} does not exist in the repository`);
        else if (dockerIgnored(src, patterns)) p.push(`${s.name}: ${src} is excluded by .dockerignore`);
      }
    }
    return p;
  });

  await check("Dockerfile: builders use scripts/install_deps.sh and the documented CMake options", () => {
    const p = [];
    for (const names of Object.values(IMAGES)) {
      const builder = stage(names.builder);
      const runtime = stage(names.runtime);
      if (!builder || !runtime) continue;
      const runs = builder.instrs.filter((i) => i.instr === "RUN").map((i) => i.rest).join("\n");
      if (!/ATTNSERVE_TEST_DEPS=0\s+bash\s+scripts\/install_deps\.sh/.test(runs)) {
        p.push(`${builder.name} must run \`ATTNSERVE_TEST_DEPS=0 bash scripts/install_deps.sh\``);
      }
      for (const opt of [`-DATTNSERVE_CUDA=${names.cuda}`, "-DATTNSERVE_TESTS=OFF"]) {
        if (!runs.includes(opt)) p.push(`${builder.name} must configure with ${opt}`);
      }
      if (!/cmake --install build --prefix \/opt\/attnserve\b/.test(runs)) {
        p.push(`${builder.name} must \`cmake --install build --prefix /opt/attnserve\``);
      }
      const rruns = runtime.instrs.filter((i) => i.instr === "RUN").map((i) => i.rest).join("\n");
      if (!/install_deps\.sh --runtime/.test(rruns)) p.push(`${runtime.name} must run install_deps.sh --runtime`);
      const copies = runtime.instrs.filter((i) => i.instr === "COPY");
      const fromBuilder = copies.filter((c) => c.rest.includes(`--from=${builder.name} `));
      if (fromBuilder.length !== 1 || !/\/opt\/attnserve\s+\/opt\/attnserve\s*$/.test(fromBuilder[0].rest)) {
        p.push(`${runtime.name} must copy exactly /opt/attnserve from ${builder.name}`);
      }
      if (copies.length !== fromBuilder.length) p.push(`${runtime.name} must copy nothing but the install tree`);
    }
    return p;
  });

  await check("Dockerfile: every top-level directory the build reads is copied into each builder", () => {
    const p = [];
    let cm = read("CMakeLists.txt");
    for (const f of fs.readdirSync(path.join(root, "cmake")).filter((f) => f.endsWith(".cmake"))) {
      cm += "\n" + read(`cmake/${f}`);
    }
    const topDirs = new Set(
      fs.readdirSync(root, { withFileTypes: true }).filter((d) => d.isDirectory()).map((d) => d.name),
    );
    for (const names of Object.values(IMAGES)) {
      const builder = stage(names.builder);
      if (!builder) continue;
      const testsOff = builder.instrs.some((i) => i.instr === "RUN" && i.rest.includes("-DATTNSERVE_TESTS=OFF"));
      const needed = new Set();
      for (const m of cm.matchAll(/(?:\$\{CMAKE_(?:CURRENT_)?SOURCE_DIR\}\/|[\s(])([A-Za-z_][\w-]*)\/[\w./-]+/g)) {
        if (topDirs.has(m[1])) needed.add(m[1]);
      }
      for (const m of cm.matchAll(/add_subdirectory\(\s*([\w-]+)/g)) needed.add(m[1]);
      if (testsOff) {
        needed.delete("tests");
        needed.delete("bench");
      }
      const copied = new Set(contextSources(builder).map((s) => s.replace(/^\.\//, "").split("/")[0]));
      for (const d of [...needed].sort()) if (!copied.has(d)) p.push(`${builder.name}: ${d}/ is read by the build but not copied`);
      if (!copied.has("CMakeLists.txt")) p.push(`${builder.name}: CMakeLists.txt is not copied`);
    }
    return p;
  });

  await check("Dockerfile: entrypoints and health checks run binaries that CMakeLists.txt builds and installs", () => {
    const p = [];
    for (const img of Object.values(images)) {
      const at = img.runtime.name;
      for (const [what, args] of [
        ["ENTRYPOINT", img.entry],
        ["HEALTHCHECK", img.healthArgv],
      ]) {
        if (!args.length) {
          p.push(`${at}: ${what} missing or not in exec form`);
          continue;
        }
        const bin = args[0];
        const m = bin.match(/^\/opt\/attnserve\/bin\/([\w-]+)$/);
        if (!m) {
          p.push(`${at}: ${what} ${bin}: expected /opt/attnserve/bin/<target>`);
          continue;
        }
        if (!targets.built.has(m[1])) p.push(`${at}: ${what} ${m[1]}: no add_executable(${m[1]}) in CMakeLists.txt`);
        if (!targets.installed.has(m[1])) p.push(`${at}: ${what} ${m[1]}: not in install(TARGETS ... RUNTIME)`);
      }
      if (img.entry[0] && !img.entry[0].endsWith("/attnserve")) p.push(`${at}: ENTRYPOINT must be the server, attnserve`);
      if (img.healthArgv.length && !img.healthArgv.includes("health")) p.push(`${at}: HEALTHCHECK must run \`attnctl health\``);
    }
    return p;
  });

  await check("Dockerfile: both images listen on 0.0.0.0, EXPOSE and health-check the same ports", () => {
    const p = [];
    for (const img of Object.values(images)) {
      const at = img.runtime.name;
      for (const [flag, addr] of [
        ["listen", img.grpcAddr],
        ["metrics_listen", img.metricsAddr],
      ]) {
        if (!/^0\.0\.0\.0:\d+$/.test(addr || "")) p.push(`${at}: --${flag}=${addr}: expected 0.0.0.0:PORT in ENTRYPOINT`);
      }
      for (const port of [img.grpcPort, img.metricsPort]) {
        if (!img.expose.includes(port)) p.push(`${at}: port ${port} is not EXPOSEd (EXPOSE ${img.expose.join(" ")})`);
      }
      const target = img.healthArgv.find((a) => a.startsWith("--target="));
      const tport = target ? Number(target.split(":").pop()) : Number(FLAGS.get("listen").split(":").pop());
      if (tport !== img.grpcPort) p.push(`${at}: HEALTHCHECK targets port ${tport}, the server listens on ${img.grpcPort}`);
    }
    const [a, b] = [images.cuda, images.cpu];
    if (a && b) {
      for (const k of ["grpcAddr", "metricsAddr", "user"]) {
        if (a[k] !== b[k]) p.push(`the two images differ in ${k}: ${a[k]} vs ${b[k]}`);
      }
    }
    return p;
  });

  await check("Dockerfile: both images run as a numeric non-root user and carry OCI labels", () => {
    const p = [];
    for (const img of Object.values(images)) {
      const at = img.runtime.name;
      const runtime = img.runtime;
      const uid = img.user.split(":")[0];
      if (!/^\d+$/.test(uid) || Number(uid) === 0) p.push(`${at}: USER ${img.user}: expected a numeric non-zero uid`);
      const labels = runtime.instrs.filter((i) => i.instr === "LABEL").map((i) => i.rest).join(" ");
      for (const k of ["title", "description", "version", "revision", "created"]) {
        if (!labels.includes(`org.opencontainers.image.${k}=`)) p.push(`${at}: missing LABEL org.opencontainers.image.${k}`);
      }
      const ver = runtime.instrs.find((i) => i.instr === "ARG" && i.rest.startsWith("ATTNSERVE_VERSION="));
      if (!ver) p.push(`${at}: missing ARG ATTNSERVE_VERSION`);
      else if (ver.rest.split("=")[1] !== targets.version) {
        p.push(`${at}: ARG ${ver.rest} differs from CMakeLists.txt's project VERSION ${targets.version}`);
      }
    }
    return p;
  });
  return images;
}

// ------------------------------------------------------------------ schemas
const MODELS = {
  v1: "kubernetes-models/v1",
  "apps/v1": "kubernetes-models/apps/v1",
  "policy/v1": "kubernetes-models/policy/v1",
  "networking.k8s.io/v1": "kubernetes-models/networking.k8s.io/v1",
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
};

// A deep copy of obj whose objects record which keys the validator reads. The
// generated validators read every property their schema names (if only to
// find it undefined) and enumerate free-form maps (labels, resources), so a
// key never read is a field the schema does not know.
function tracked(obj, records, at = "") {
  if (Array.isArray(obj)) return obj.map((v, i) => tracked(v, records, `${at}[${i}]`));
  if (obj === null || typeof obj !== "object") return obj;
  const copy = {};
  for (const [k, v] of Object.entries(obj)) copy[k] = tracked(v, records, `${at}.${k}`);
  const rec = { at, keys: Object.keys(obj), read: new Set(), enumerated: false };
  records.push(rec);
  return new Proxy(copy, {
    get(t, k, r) {
      if (typeof k === "string") rec.read.add(k);
      return Reflect.get(t, k, r);
    },
    ownKeys(t) {
      rec.enumerated = true;
      return Reflect.ownKeys(t);
    },
  });
}

async function schemaCheck(obj) {
  const p = [];
  const mod = MODELS[obj.apiVersion];
  if (!mod) return [`no schema for apiVersion ${obj.apiVersion}`];
  const models = await import(mod);
  const Model = models[obj.kind];
  if (!Model) return [`no schema for ${obj.apiVersion} ${obj.kind}`];
  try {
    new Model(obj).validate();
  } catch (e) {
    p.push(`schema: ${e.message}`);
  }
  const records = [];
  const proxy = tracked(obj, records);
  try {
    Model.prototype.validate.call(proxy);
  } catch {
    // reported above
  }
  for (const r of records) {
    if (r.enumerated || r.read.size === 0) continue; // a map, or free-form
    for (const k of r.keys) if (!r.read.has(k)) p.push(`unknown field ${r.at}.${k}`);
  }
  return p;
}

// ------------------------------------------------------------------ one overlay
const selects = (selector, labels) =>
  !!selector && Object.entries(selector).every(([k, v]) => labels && labels[k] === v);
const matchLabelsSelects = (sel, labels) =>
  !!sel && (!sel.matchExpressions || sel.matchExpressions.length === 0) && selects(sel.matchLabels || {}, labels);

function flagLines(text) {
  return text
    .split("\n")
    .map((l) => l.trim())
    .filter((l) => l && !l.startsWith("#"));
}
const flagName = (a) => (a.match(/^--?([\w-]+)/) || [])[1];

// A Kubernetes resource quantity ("8", 8, "500m", "32Gi") as a number, for
// comparisons; undefined stays undefined.
function quantity(q) {
  if (q === undefined || q === null) return undefined;
  const m = String(q).match(/^([0-9.]+)(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$/);
  if (!m) return String(q);
  const scale = { m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15, Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, Pi: 2 ** 50 };
  return Number(m[1]) * (m[2] ? scale[m[2]] : 1);
}

async function overlayChecks(name, objs, images) {
  for (const o of objs) {
    await check(`${name}: ${o.kind}/${o.metadata && o.metadata.name} is valid (schema, no unknown fields)`, () =>
      schemaCheck(o),
    );
  }
  const of = (kind) => objs.filter((o) => o.kind === kind);
  const sts = of("StatefulSet")[0];
  await check(
    `${name}: renders one StatefulSet, two Services, a PDB, a NetworkPolicy, and a ServiceMonitor with a PrometheusRule or neither`,
    () => {
      const p = [];
      const want = { StatefulSet: 1, Deployment: 0, Service: 2, PodDisruptionBudget: 1, NetworkPolicy: 1, ConfigMap: 1 };
      for (const [k, n] of Object.entries(want)) if (of(k).length !== n) p.push(`${k}: ${of(k).length}, want ${n}`);
      // The monitoring component brings both, or the overlay has neither.
      const sm = of("ServiceMonitor").length;
      const pr = of("PrometheusRule").length;
      if (sm > 1 || pr > 1 || sm !== pr) p.push(`${sm} ServiceMonitors and ${pr} PrometheusRules, want 1 and 1 or 0 and 0`);
      return p;
    },
  );
  if (!sts) return;
  const pod = sts.spec.template;
  const podLabels = pod.metadata.labels;
  const c = pod.spec.containers.find((x) => x.name === "attnserve") || pod.spec.containers[0];
  // The image this overlay runs, as the Dockerfile builds it.
  const img = images ? images[imageKind(c.image)] : null;
  const namedPorts = Object.fromEntries((c.ports || []).map((p) => [p.name, p.containerPort]));
  const resolvePort = (p) => (typeof p === "number" ? p : namedPorts[p]);

  // The flags the server will see: entrypoint, then args, then the flagfile.
  const args = [...(c.command ? c.command.slice(1) : img ? img.entry.slice(1) : []), ...(c.args || [])];
  let fileFlags = [];
  let flagfileProblem = null;
  const ff = args.find((a) => a.startsWith("--flagfile="));
  if (ff) {
    const file = ff.split("=")[1];
    const mount = (c.volumeMounts || []).find((m) => file.startsWith(m.mountPath + "/"));
    const vol = mount && pod.spec.volumes.find((v) => v.name === mount.name);
    const cm = vol && vol.configMap && of("ConfigMap").find((x) => x.metadata.name === vol.configMap.name);
    const key = mount && file.slice(mount.mountPath.length + 1);
    if (!cm || !cm.data || !(key in cm.data)) flagfileProblem = `--flagfile=${file} is not a key of a mounted ConfigMap`;
    else fileFlags = flagLines(cm.data[key]);
  }
  const allFlags = [...args, ...fileFlags];
  const flagValue = (n) => {
    let v;
    for (const a of allFlags) if (flagName(a) === n) v = a.split("=").slice(1).join("=");
    return v === undefined ? FLAGS.get(n) : v;
  };

  await check(`${name}: every flag (args and ConfigMap) is one the server defines`, () => {
    const p = flagfileProblem ? [flagfileProblem] : [];
    for (const a of allFlags) {
      const n = flagName(a);
      if (!n || !a.startsWith("--")) p.push(`"${a}" is not a --flag`);
      else if (!FLAGS.has(n) && !BUILTIN_FLAGS.has(n)) p.push(`--${n} is not defined in server/flags.cc`);
    }
    return p;
  });

  await check(`${name}: container ports and probes match the image's listen addresses`, () => {
    const p = [];
    if (!img) return [`no Dockerfile stage builds ${c.image}`];
    if (c.command) p.push("the container sets `command`, replacing the image's entrypoint");
    const grpc = Number(String(flagValue("listen")).split(":").pop());
    const metrics = Number(String(flagValue("metrics_listen")).split(":").pop());
    if (grpc !== img.grpcPort || metrics !== img.metricsPort) {
      p.push(`flags move the ports to ${grpc}/${metrics}; the image has ${img.grpcPort}/${img.metricsPort}`);
    }
    if (namedPorts.grpc !== grpc) p.push(`containerPort "grpc" is ${namedPorts.grpc}, the server listens on ${grpc}`);
    if (namedPorts.metrics !== metrics) p.push(`containerPort "metrics" is ${namedPorts.metrics}, /metrics is on ${metrics}`);
    for (const kind of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      const probe = c[kind];
      if (!probe) {
        p.push(`no ${kind}`);
        continue;
      }
      if (probe.grpc) {
        if (probe.grpc.port !== grpc) p.push(`${kind} probes port ${probe.grpc.port}, gRPC is on ${grpc}`);
        if (![undefined, "", "attnserve.v1.AttentionService"].includes(probe.grpc.service)) {
          p.push(`${kind} asks for health of unknown service ${probe.grpc.service}`);
        }
      } else if (probe.exec) {
        const cmd = probe.exec.command || [];
        const t = cmd.find((a) => a.startsWith("--target="));
        if (!cmd[0] || !cmd[0].endsWith("/attnctl") || !cmd.includes("health")) {
          p.push(`${kind} exec must run attnctl health`);
        }
        if (!t || Number(t.split(":").pop()) !== grpc) p.push(`${kind} exec targets ${t}, gRPC is on ${grpc}`);
      } else {
        p.push(`${kind} is neither a gRPC health probe nor attnctl health`);
      }
    }
    return p;
  });

  await check(`${name}: terminationGracePeriodSeconds outlasts preStop plus --drain_timeout_s`, () => {
    const drain = Number(flagValue("drain_timeout_s"));
    const pre = c.lifecycle && c.lifecycle.preStop;
    let preSec = 0;
    if (pre && pre.exec) {
      const cmd = pre.exec.command;
      if (cmd[0] === "sleep" || cmd[0] === "/bin/sleep") preSec = Number(cmd[1]);
      else return [`preStop ${cmd.join(" ")}: only a sleep is understood`];
    } else if (pre && pre.sleep) preSec = pre.sleep.seconds;
    const grace = pod.spec.terminationGracePeriodSeconds ?? 30;
    return grace > drain + preSec ? [] : [`grace ${grace} s <= preStop ${preSec} s + drain ${drain} s`];
  });

  await check(`${name}: pod and container securityContext are restrictive and match the image's user`, () => {
    const p = [];
    const ps = pod.spec.securityContext || {};
    const cs = c.securityContext || {};
    if (ps.runAsNonRoot !== true && cs.runAsNonRoot !== true) p.push("runAsNonRoot is not true");
    const uid = cs.runAsUser ?? ps.runAsUser;
    if (img && String(uid) !== img.user.split(":")[0]) p.push(`runAsUser ${uid} differs from the image's USER ${img.user}`);
    if (cs.readOnlyRootFilesystem !== true) p.push("readOnlyRootFilesystem is not true");
    if (cs.allowPrivilegeEscalation !== false) p.push("allowPrivilegeEscalation is not false");
    if (cs.privileged === true) p.push("privileged");
    if (!cs.capabilities || !(cs.capabilities.drop || []).includes("ALL")) p.push("capabilities do not drop ALL");
    if ((cs.capabilities && cs.capabilities.add || []).length) p.push("capabilities are added");
    const seccomp = (cs.seccompProfile || ps.seccompProfile || {}).type;
    if (seccomp !== "RuntimeDefault" && seccomp !== "Localhost") p.push("no seccompProfile");
    if (pod.spec.automountServiceAccountToken !== false) p.push("the service account token is mounted");
    if (pod.spec.hostNetwork || pod.spec.hostPID || pod.spec.hostIPC) p.push("uses host namespaces");
    return p;
  });

  await check(
    `${name}: resources have requests and limits (gpu overlays: one GPU, requests equal to limits; none elsewhere)`,
    () => {
      const p = [];
      const r = c.resources || {};
      for (const k of ["cpu", "memory"]) {
        if (!r.requests || r.requests[k] === undefined) p.push(`no ${k} request`);
        if (!r.limits || r.limits[k] === undefined) p.push(`no ${k} limit`);
      }
      const gpu = r.limits && r.limits["nvidia.com/gpu"];
      const backend = flagValue("backend");
      if (/gpu/.test(name)) {
        if (String(gpu) !== "1") p.push(`limits nvidia.com/gpu is ${gpu}, want 1 (one server per GPU)`);
        if (backend !== "cuda") p.push(`--backend=${backend}, want cuda`);
        // Guaranteed QoS: every container's requests equal its limits.
        for (const x of [...(pod.spec.initContainers || []), ...pod.spec.containers]) {
          const xr = x.resources || {};
          const keys = new Set(["cpu", "memory", ...Object.keys(xr.requests || {}), ...Object.keys(xr.limits || {})]);
          for (const k of keys) {
            const [q, l] = [(xr.requests || {})[k], (xr.limits || {})[k]];
            if (q === undefined || quantity(q) !== quantity(l)) {
              p.push(`${x.name}: ${k} request ${q} differs from limit ${l} (not Guaranteed QoS)`);
            }
          }
        }
      } else if (/cpu/.test(name)) {
        if (gpu !== undefined) p.push("a cpu overlay asks for a GPU");
        if (backend !== "cpu") p.push(`--backend=${backend}, want cpu`);
      }
      return p;
    },
  );
  await check(`${name}: the memory limit holds --max_queue_bytes (and a CPU backend's KV cache)`, () => {
    const limit = quantity(((c.resources || {}).limits || {}).memory);
    if (typeof limit !== "number") return [`memory limit ${limit} is not a quantity`];
    // A default as main.cc writes it: a number, or int64_t{N} << S.
    const bytes = (v) => {
      const m = String(v).match(/^int64_t\{(\d+)\}\s*<<\s*(\d+)$/);
      return m ? Number(m[1]) * 2 ** Number(m[2]) : Number(v);
    };
    const queue = bytes(flagValue("max_queue_bytes"));
    let cache = 0;
    if (flagValue("backend") !== "cuda") {
      // cpu, or auto on a node without a GPU: the cache is host memory.
      const n = (f) => Number(flagValue(f));
      const page = n("num_layers") * n("page_size") * n("num_kv_heads") * n("head_dim") * 2 *
        (String(flagValue("kv_dtype")).startsWith("fp8") ? 1 : 2);
      const kvBytes = bytes(flagValue("kv_cache_bytes"));
      cache = kvBytes > 0 ? kvBytes : n("num_pages") * page;
    }
    const margin = 256 * 2 ** 20;  // the process, gRPC's buffers, the page table
    const need = queue + cache + margin;
    return need <= limit
      ? []
      : [`--max_queue_bytes ${queue} + KV cache ${cache} + 256 MiB = ${need} bytes exceed the memory limit ${limit}: ` +
         `the server would be OOM-killed before it refuses a request (lower --max_queue_bytes)`];
  });
  await check(`${name}: image is pinned to a tag or digest and is its backend's image (-cpu: the runtime-cpu target)`, () => {
    const p = [];
    for (const x of pod.spec.containers) {
      const m = x.image.match(/^(.*?)(?::([\w.-]+))?(?:@sha256:[0-9a-f]{64})?$/);
      if (!x.image.includes("@sha256:") && (!m[2] || m[2] === "latest")) p.push(`${x.image}: no tag or :latest`);
    }
    const backend = flagValue("backend");
    const kind = imageKind(c.image);
    if (backend === "cpu" && kind !== "cpu") p.push(`--backend=cpu runs ${c.image}, not the CPU image (a tag ending in -cpu)`);
    if (backend !== "cpu" && kind === "cpu") p.push(`--backend=${backend} runs the CPU image ${c.image}, which has no CUDA backend`);
    if (images && !images[kind]) p.push(`no Dockerfile stage ${IMAGES[kind].runtime} builds ${c.image}`);
    return p;
  });
  await check(`${name}: the StatefulSet names the headless Service, which gives each pod a DNS name`, () => {
    const p = [];
    const svc = of("Service").find((x) => x.metadata.name === sts.spec.serviceName);
    if (!svc) return [`serviceName ${sts.spec.serviceName} is not a Service of the overlay`];
    if (svc.spec.clusterIP !== "None") p.push(`Service/${svc.metadata.name} is not headless (clusterIP: None)`);
    if (!selects(svc.spec.selector, podLabels)) p.push(`Service/${svc.metadata.name} misses the pods`);
    if (!(svc.spec.ports || []).some((x) => x.name === "grpc")) p.push(`Service/${svc.metadata.name} has no grpc port`);
    if ((sts.spec.updateStrategy || {}).type === "OnDelete") p.push("updateStrategy OnDelete: a rollout would never replace pods");
    if ((sts.spec.volumeClaimTemplates || []).length) {
      p.push("volumeClaimTemplates: the KV cache lives in device memory, not on a volume");
    }
    return p;
  });
  await check(`${name}: pods spread over nodes (a hard rule on gpu overlays) and zones`, () => {
    const p = [];
    const ps = pod.spec;
    const anti = (ps.affinity && ps.affinity.podAntiAffinity) || {};
    const onNodes = (t) => t.topologyKey === "kubernetes.io/hostname" && matchLabelsSelects(t.labelSelector, podLabels);
    const required = (anti.requiredDuringSchedulingIgnoredDuringExecution || []).filter(onNodes);
    const preferred = (anti.preferredDuringSchedulingIgnoredDuringExecution || []).filter((w) => onNodes(w.podAffinityTerm));
    const spreads = ps.topologySpreadConstraints || [];
    // Hard: at most one pod per node, or an even spread over nodes (README's
    // variant for several servers per multi-GPU node).
    const hardSpread = spreads.filter((t) => onNodes(t) && t.whenUnsatisfiable === "DoNotSchedule" && t.maxSkew === 1);
    if (/gpu/.test(name) && !required.length && !hardSpread.length) {
      p.push("neither a required podAntiAffinity nor a DoNotSchedule spread on kubernetes.io/hostname: two GPU servers could share a node");
    }
    if (!required.length && !preferred.length && !hardSpread.length) p.push("no podAntiAffinity on kubernetes.io/hostname for the pods");
    for (const t of spreads) {
      if (!matchLabelsSelects(t.labelSelector, podLabels)) p.push(`topology spread over ${t.topologyKey} misses the pods`);
    }
    if (!spreads.some((t) => t.topologyKey === "topology.kubernetes.io/zone")) {
      p.push("no topologySpreadConstraint over topology.kubernetes.io/zone");
    }
    return p;
  });
  await check(`${name}: selectors of the StatefulSet, Services, PDB and NetworkPolicy pick the pods`, () => {
    const p = [];
    if (!matchLabelsSelects(sts.spec.selector, podLabels)) p.push("StatefulSet selector misses its own pods");
    for (const s of of("Service")) if (!selects(s.spec.selector, podLabels)) p.push(`Service/${s.metadata.name} misses the pods`);
    for (const b of of("PodDisruptionBudget")) {
      if (!matchLabelsSelects(b.spec.selector, podLabels)) p.push(`PDB/${b.metadata.name} misses the pods`);
      if (b.spec.minAvailable !== undefined) p.push("PDB uses minAvailable: with one replica no node could drain");
    }
    for (const n of of("NetworkPolicy")) {
      if (!matchLabelsSelects(n.spec.podSelector, podLabels)) p.push(`NetworkPolicy/${n.metadata.name} misses the pods`);
    }
    return p;
  });

  await check(`${name}: Services expose named grpc and metrics ports that reach the container`, () => {
    const p = [];
    const svcs = of("Service");
    const headless = svcs.filter((s) => s.spec.clusterIP === "None");
    const normal = svcs.filter((s) => s.spec.clusterIP !== "None");
    if (headless.length !== 1) p.push(`${headless.length} headless Services, want 1`);
    if (normal.length !== 1) p.push(`${normal.length} ClusterIP Services, want 1`);
    for (const s of svcs) {
      for (const sp of s.spec.ports) {
        if (resolvePort(sp.targetPort ?? sp.port) === undefined) {
          p.push(`Service/${s.metadata.name} port ${sp.name} targets ${sp.targetPort}, not a container port`);
        }
      }
    }
    for (const s of normal) {
      const names = s.spec.ports.map((x) => x.name);
      for (const n of ["grpc", "metrics"]) if (!names.includes(n)) p.push(`Service/${s.metadata.name} has no port named ${n}`);
    }
    for (const s of headless) {
      if (!s.spec.ports.some((x) => x.name === "grpc")) p.push(`Service/${s.metadata.name} has no port named grpc`);
    }
    return p;
  });

  await check(`${name}: the ServiceMonitor scrapes the metrics port of exactly one Service`, () => {
    const p = [];
    for (const sm of of("ServiceMonitor")) {
      const hits = of("Service").filter((s) => matchLabelsSelects(sm.spec.selector, s.metadata.labels));
      if (hits.length !== 1) {
        p.push(
          hits.length
            ? `selects ${hits.length} Services (${hits.map((s) => s.metadata.name)}): each pod would be scraped twice`
            : "selects no Service",
        );
        continue;
      }
      for (const ep of sm.spec.endpoints) {
        const sp = hits[0].spec.ports.find((x) => x.name === ep.port);
        if (!sp) p.push(`endpoint port ${ep.port} is not a port of Service/${hits[0].metadata.name}`);
        else if (resolvePort(sp.targetPort) !== namedPorts.metrics) p.push(`endpoint port ${ep.port} does not reach /metrics`);
        if ((ep.path || "/metrics") !== "/metrics") p.push(`path ${ep.path}, the server serves /metrics`);
      }
      if (hits[0] && hits[0].metadata.name !== "attnserve") {
        p.push(`job label would be "${hits[0].metadata.name}"; the alert rules select job="attnserve"`);
      }
    }
    return p;
  });

  await check(`${name}: NetworkPolicy admits gRPC from labelled clients and metrics from monitoring only`, () => {
    const p = [];
    for (const n of of("NetworkPolicy")) {
      const types = n.spec.policyTypes || [];
      if (!types.includes("Ingress")) p.push("no Ingress policy type");
      const byPort = {};
      for (const rule of n.spec.ingress || []) {
        if (!rule.from || rule.from.length === 0) p.push("an ingress rule admits everyone");
        for (const port of rule.ports || []) {
          const num = resolvePort(port.port);
          if (num === undefined) p.push(`port ${port.port} is not a container port`);
          (byPort[num] = byPort[num] || []).push(...(rule.from || []));
        }
        if (!rule.ports || rule.ports.length === 0) p.push("an ingress rule admits every port");
      }
      const g = byPort[namedPorts.grpc] || [];
      const m = byPort[namedPorts.metrics] || [];
      if (!g.length || !g.every((f) => f.podSelector && Object.keys(f.podSelector.matchLabels || {}).length)) {
        p.push("gRPC must be admitted only from pods selected by label");
      }
      if (
        !m.length ||
        !m.every((f) => f.namespaceSelector && (f.namespaceSelector.matchLabels || {})["kubernetes.io/metadata.name"])
      ) {
        p.push("metrics must be admitted only from a namespace named by kubernetes.io/metadata.name");
      }
    }
    return p;
  });

  await check(`${name}: Secrets hold placeholders only`, () => {
    const p = [];
    for (const s of of("Secret")) {
      const values = {
        ...Object.fromEntries(Object.entries(s.data || {}).map(([k, v]) => [k, Buffer.from(v, "base64").toString()])),
        ...(s.stringData || {}),
      };
      for (const [k, v] of Object.entries(values)) {
        const real = flagLines(v).filter((l) => !/^-----(BEGIN|END) /.test(l) && !/REPLACE_/.test(l));
        if (real.length) p.push(`Secret/${s.metadata.name} key ${k} holds something other than placeholders`);
      }
    }
    return p;
  });
}

// ------------------------------------------------------------------ metrics
const METRIC_TYPES = new Set(["counter", "gauge", "histogram", "summary"]);
// The families docs/design.md section 7 lists: a table that parses to fewer
// means the parser or the table broke.
const CONTRACT_FAMILIES = 22;

// docs/design.md section 7: name -> { type, labels: { label: [values] | null } }.
function parseMetricTable(md, heading) {
  const start = md.search(heading);
  if (start < 0) return null;
  const rest = md.slice(start);
  const next = rest.slice(1).search(/\n## /);
  const section = next < 0 ? rest : rest.slice(0, next + 1);
  const metrics = new Map();
  for (const line of section.split("\n")) {
    const cells = line.split("|").map((s) => s.trim());
    if (cells.length < 5) continue;
    // Any Prometheus metric name (attnserve_* and process_start_time_seconds)
    // whose type cell is a metric type: header and other tables do not match.
    const name = (cells[1].match(/^`([a-zA-Z_:][\w:]*)`$/) || [])[1];
    const type = cells[2].split(/\s/)[0];
    if (!name || !METRIC_TYPES.has(type)) continue;
    const labels = {};
    const labelCell = cells[3].replace(/\(([^)]*)\)/g, (_, inner) => `(${inner.replace(/`/g, "'")})`);
    for (const m of labelCell.matchAll(/`(\w+)`(?:\s*\(([^)]*)\))?/g)) {
      labels[m[1]] = m[2] ? [...m[2].matchAll(/'(\w+)'/g)].map((x) => x[1]) : null;
    }
    metrics.set(name, { type, labels });
  }
  return metrics;
}

function findDesign() {
  const candidates = [process.env.ATTNSERVE_DESIGN, path.join(root, "docs/design.md")].filter(Boolean);
  return candidates.find((c) => fs.existsSync(c));
}

const GRPC_CODES = [
  "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
  "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
  "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
];
// Labels Prometheus attaches to every scraped series.
const TARGET_LABELS = new Set(["job", "instance", "namespace", "pod", "service", "container", "endpoint"]);
const AGGREGATIONS = new Set([
  "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
]);
const FUNCTIONS = new Set([
  "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "day_of_month",
  "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_quantile",
  "histogram_count", "histogram_sum", "histogram_fraction", "holt_winters", "hour", "idelta", "increase",
  "irate", "label_join", "label_replace", "ln", "log2", "log10", "minute", "month", "predict_linear", "rate",
  "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "time", "timestamp", "vector", "year",
  "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time",
  "stddev_over_time", "stdvar_over_time", "last_over_time", "present_over_time",
]);
const LABEL_LIST_KEYWORDS = new Set(["by", "without", "on", "ignoring", "group_left", "group_right"]);
const OPERATOR_WORDS = new Set(["and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"]);

// The series selectors and grouping labels of one PromQL expression.
function promqlRefs(expr) {
  const tokens = [];
  const re =
    /\s+|("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)|(\$\{?\w+\}?|\[\[\w+\]\])|(\d+(?:ms|s|m|h|d|w|y)(?:\d+(?:ms|s|m|h|d|w|y))*)|(\d*\.?\d+(?:[eE][-+]?\d+)?)|([A-Za-z_:][\w:]*)|(=~|!~|!=|==|>=|<=|[{}()[\],=<>+\-*/%^@:])/y;
  let m;
  while (re.lastIndex < expr.length) {
    const at = re.lastIndex;
    m = re.exec(expr);
    if (!m) throw new Error(`cannot tokenize at "${expr.slice(at, at + 20)}"`);
    if (m[1]) tokens.push({ t: "str", v: m[1].slice(1, -1) });
    else if (m[2]) tokens.push({ t: "var", v: m[2] });
    else if (m[3] || m[4]) tokens.push({ t: "num", v: m[3] || m[4] });
    else if (m[5]) tokens.push({ t: "id", v: m[5] });
    else if (m[6]) tokens.push({ t: "op", v: m[6] });
  }
  const selectors = [];
  const groupLabels = [];
  const problems = [];
  for (let i = 0; i < tokens.length; i++) {
    const tok = tokens[i];
    const next = tokens[i + 1];
    if (tok.t === "op" && tok.v === "[") {
      while (i < tokens.length && !(tokens[i].t === "op" && tokens[i].v === "]")) i++;
      continue;
    }
    if (tok.t === "op" && tok.v === "{") {
      problems.push("a selector without a metric name");
      continue;
    }
    if (tok.t !== "id") continue;
    if (LABEL_LIST_KEYWORDS.has(tok.v)) {
      if (next && next.v === "(") {
        i += 2;
        for (; i < tokens.length && tokens[i].v !== ")"; i++) if (tokens[i].t === "id") groupLabels.push(tokens[i].v);
      }
      continue;
    }
    if (OPERATOR_WORDS.has(tok.v)) {
      if (tok.v === "offset") i++;
      continue;
    }
    if (AGGREGATIONS.has(tok.v) && next && (next.v === "(" || LABEL_LIST_KEYWORDS.has(next.v))) continue;
    if (next && next.v === "(") {
      if (!FUNCTIONS.has(tok.v)) problems.push(`unknown function ${tok.v}()`);
      continue;
    }
    const sel = { name: tok.v, matchers: [] };
    if (next && next.v === "{") {
      i += 2;
      for (; i < tokens.length && tokens[i].v !== "}"; i++) {
        if (tokens[i].t === "id") {
          const op = tokens[i + 1];
          const val = tokens[i + 2];
          sel.matchers.push({ label: tokens[i].v, op: op && op.v, value: val && val.v });
          i += 2;
        }
      }
    }
    selectors.push(sel);
  }
  return { selectors, groupLabels, problems };
}

// Problems with one expression's names, labels and label values.
function checkExpr(expr, known, allowUp) {
  const p = [];
  let refs;
  try {
    refs = promqlRefs(expr);
  } catch (e) {
    return [e.message];
  }
  p.push(...refs.problems);
  const usable = new Set(TARGET_LABELS);
  for (const sel of refs.selectors) {
    let base = null;
    let suffix = "";
    if (known.has(sel.name)) base = sel.name;
    else {
      const m = sel.name.match(/^(\w+?)_(bucket|sum|count)$/);
      if (m && known.has(m[1])) [base, suffix] = [m[1], m[2]];
    }
    if (sel.name === "up" && allowUp) {
      for (const mt of sel.matchers) if (!TARGET_LABELS.has(mt.label)) p.push(`up{${mt.label}}: not a target label`);
      continue;
    }
    if (!base) {
      p.push(`${sel.name} is not a docs/design.md section 7 metric`);
      continue;
    }
    const info = known.get(base);
    if (info.type === "histogram" && !suffix) p.push(`${sel.name} is a histogram: use _bucket, _sum or _count`);
    if (info.type !== "histogram" && suffix) p.push(`${sel.name}: ${base} is a ${info.type}, not a histogram`);
    const labels = new Set([...Object.keys(info.labels), ...TARGET_LABELS, ...(suffix === "bucket" ? ["le"] : [])]);
    for (const l of labels) usable.add(l);
    for (const mt of sel.matchers) {
      if (!labels.has(mt.label)) {
        p.push(`${sel.name}{${mt.label}}: ${base} has no label ${mt.label}`);
        continue;
      }
      const values = mt.label === "code" ? GRPC_CODES : info.labels[mt.label];
      if (!values || typeof mt.value !== "string" || mt.value.includes("$")) continue;
      const literal = /^[\w|]+$/.test(mt.value);
      if (!literal && (mt.op === "=~" || mt.op === "!~")) continue;
      for (const v of mt.value.split("|")) {
        if (!values.includes(v)) p.push(`${sel.name}{${mt.label}="${v}"}: not one of ${values.join(", ")}`);
      }
    }
  }
  for (const l of refs.groupLabels) if (!usable.has(l)) p.push(`groups by ${l}, a label none of its metrics has`);
  return p;
}

async function metricChecks() {
  const designPath = findDesign();
  const opsPath = path.join(root, "docs/operations.md");
  const design = designPath ? parseMetricTable(fs.readFileSync(designPath, "utf8"), /\n## 7\. Metrics/) : null;
  const ops = fs.existsSync(opsPath)
    ? parseMetricTable(fs.readFileSync(opsPath, "utf8"), /\n## Metrics/)
    : null;
  // docs/design.md is the contract; docs/operations.md mirrors it.
  const known = design && design.size ? design : ops;
  const source = design && design.size ? path.relative(root, designPath) : "docs/operations.md";
  console.log(`#    metric names from ${source}`);

  const methods = [...read("proto/attnserve/v1/attention.proto").matchAll(/\brpc\s+(\w+)/g)].map((m) => m[1]);
  if (known && known.has("attnserve_requests_total")) {
    for (const n of ["attnserve_requests_total", "attnserve_request_duration_seconds"]) {
      if (known.get(n) && "method" in known.get(n).labels) known.get(n).labels.method = methods;
    }
  }

  await check(`metrics: the contract's table lists the ${CONTRACT_FAMILIES} families`, () =>
    known && known.size === CONTRACT_FAMILIES ? [] : [`found ${known ? known.size : 0} metrics in ${source}`],
  );
  if (!known) return;

  await check("metrics: docs/operations.md lists exactly docs/design.md section 7's metrics, types and labels", () => {
    const p = [];
    if (!ops) return ["docs/operations.md has no '## Metrics' table"];
    if (!design) return []; // nothing to compare with
    for (const [n, info] of design) {
      const o = ops.get(n);
      if (!o) p.push(`${n} missing`);
      else if (o.type !== info.type || Object.keys(o.labels).join() !== Object.keys(info.labels).join()) {
        p.push(`${n}: ${o.type} {${Object.keys(o.labels)}} vs ${info.type} {${Object.keys(info.labels)}}`);
      }
    }
    for (const n of ops.keys()) if (!design.has(n)) p.push(`${n} is not in docs/design.md section 7`);
    return p;
  });

  // Families beyond the contract must be documented in their own table.
  const extra = fs.existsSync(opsPath)
    ? parseMetricTable(fs.readFileSync(opsPath, "utf8"), /\n## Metrics beyond docs\/design\.md/) || new Map()
    : new Map();
  await check("metrics: server/metrics.cc and server/process_metrics.cc register the contract's names, and only documented extras", () => {
    const src = read("server/metrics.cc");
    const names = new Set([...src.matchAll(/\.Name\("(\w+)"\)/g)].map((m) => m[1]));
    for (const m of read("server/process_metrics.cc").matchAll(/"(process_\w+)"/g)) names.add(m[1]);
    const p = [];
    for (const n of known.keys()) if (!names.has(n)) p.push(`${n} is not registered`);
    for (const n of names) {
      if (!known.has(n) && !extra.has(n)) p.push(`${n} is registered but neither in the contract nor in docs/operations.md's extras`);
    }
    for (const n of extra.keys()) if (known.has(n)) p.push(`${n} is in the contract and in the extras`);
    return p;
  });

  // The alert rules.
  const rules = parseYaml(read("deploy/prometheus/alerts.yaml"));
  for (const g of rules.groups || []) {
    for (const r of g.rules || []) {
      await check(`rules: ${r.alert || r.record} uses only contract metrics, labels and values`, () =>
        checkExpr(r.expr, known, true),
      );
    }
  }
  const allRules = (rules.groups || []).flatMap((g) => g.rules);
  const alertNames = [...new Set(allRules.map((r) => r.alert))];
  await check(
    "rules: alerts for error ratio, queue full, decode and prefill p99 latency, KV pages and instance down, each unit-tested",
    () => {
    const p = [];
    const tests = read("deploy/prometheus/alerts_test.yaml");
    for (const want of [/ErrorRatio/, /QueueFull/, /Latency/, /KvPages/, /InstanceDown/]) {
      if (!alertNames.some((a) => want.test(a))) p.push(`no alert matching ${want}`);
    }
    // Latency alerts apart for decode and prefill (their p99s differ by orders
    // of magnitude), and an absent() form of instance down for targets gone
    // from discovery.
    const selectsShape = (r, shape) =>
      promqlRefs(r.expr).selectors.some((x) =>
        x.matchers.some((m) => m.label === "shape" && m.op === "=" && m.value === shape),
      );
    for (const shape of ["decode", "prefill"]) {
      if (!allRules.some((r) => /Latency/.test(r.alert) && selectsShape(r, shape))) {
        p.push(`no latency alert selects shape="${shape}"`);
      }
    }
    if (!allRules.some((r) => /InstanceDown/.test(r.alert) && /\babsent\s*\(/.test(r.expr))) {
      p.push("no absent() form of the instance-down alert");
    }
    for (const a of alertNames) {
      const t = parseYaml(tests).tests.flatMap((x) => x.alert_rule_test || []).filter((x) => x.alertname === a);
      if (!t.some((x) => x.exp_alerts && x.exp_alerts.length)) p.push(`${a}: no test where it fires`);
      if (!t.some((x) => !x.exp_alerts || x.exp_alerts.length === 0)) p.push(`${a}: no test where it stays silent`);
    }
    return p;
    },
  );

  // The dashboard.
  const dashText = read("deploy/grafana/attnserve-dashboard.json");
  let dash;
  await check("dashboard: valid JSON with a Prometheus datasource variable used by every panel and query", () => {
    dash = JSON.parse(dashText);
    const p = [];
    const vars = (dash.templating && dash.templating.list) || [];
    const dsVar = vars.find((v) => v.type === "datasource" && v.query === "prometheus");
    if (!dsVar) return ["no templating variable of type datasource (prometheus)"];
    const ref = `\${${dsVar.name}}`;
    const walk = (obj, at) => {
      if (Array.isArray(obj)) obj.forEach((x, i) => walk(x, `${at}[${i}]`));
      else if (obj && typeof obj === "object") {
        if ("datasource" in obj && at !== "" && !(obj.datasource && obj.datasource.type === "grafana")) {
          const d = obj.datasource;
          const uid = typeof d === "string" ? d : d && d.uid;
          if (uid !== ref && uid !== `$${dsVar.name}`) p.push(`${at}: datasource ${JSON.stringify(d)}, want ${ref}`);
        }
        for (const [k, v] of Object.entries(obj)) walk(v, `${at}.${k}`);
      }
    };
    walk({ panels: dash.panels, templating: vars.filter((v) => v !== dsVar) }, "");
    const ids = new Set();
    for (const pn of dash.panels) {
      if (ids.has(pn.id)) p.push(`duplicate panel id ${pn.id}`);
      ids.add(pn.id);
      if (!pn.gridPos) p.push(`panel ${pn.title}: no gridPos`);
      if (pn.type !== "row" && !(pn.targets || []).length) p.push(`panel ${pn.title}: no queries`);
    }
    return p;
  });
  if (!dash) return;
  const exprs = [];
  for (const pn of dash.panels) for (const t of pn.targets || []) exprs.push([pn.title, t.expr]);
  for (const v of dash.templating.list) {
    const q = typeof v.query === "string" ? v.query : v.query && v.query.query;
    const lv = q && q.match(/^label_values\((.*),\s*(\w+)\)$/);
    if (lv) exprs.push([`variable ${v.name}`, lv[1]]);
  }
  // The dashboard also shows the documented extras (the runbook points at them).
  const shown = new Map([...known, ...extra]);
  await check("dashboard: every query uses only contract metrics and documented extras, their labels and values", () => {
    const p = [];
    for (const [title, e] of exprs) for (const x of checkExpr(e, shown, false)) p.push(`${title}: ${x}`);
    return p;
  });
  // A series shown in bytes is a byte count: its metric's name says so
  // (a count of leases or regions on a bytes axis reads "2 B").
  await check("dashboard: every series on a bytes axis is a byte count, every byte count on one", () => {
    const p = [];
    for (const pn of dash.panels) {
      const defaults = (pn.fieldConfig && pn.fieldConfig.defaults) || {};
      const unitOf = (refId) => {
        let unit = defaults.unit;
        for (const o of (pn.fieldConfig && pn.fieldConfig.overrides) || []) {
          if (o.matcher && o.matcher.id === "byFrameRefID" && o.matcher.options === refId) {
            for (const prop of o.properties || []) if (prop.id === "unit") unit = prop.value;
          }
        }
        return unit;
      };
      for (const t of pn.targets || []) {
        const names = promqlRefs(t.expr).selectors.map((x) => x.name);
        const bytes = names.length > 0 && names.every((n) => /_bytes(_total|_sum|_count|_bucket)?$/.test(n));
        const unit = unitOf(t.refId);
        if (unit === "bytes" && !bytes) p.push(`${pn.title} ${t.refId}: ${names.join(", ")} on a bytes axis`);
        if (bytes && unit !== "bytes" && unit !== "Bps" && unit !== "binBps" && !/histogram_quantile|\//.test(t.expr)) {
          p.push(`${pn.title} ${t.refId}: ${names.join(", ")} (bytes) shown as ${unit}`);
        }
      }
    }
    return p;
  });
  await check("dashboard: every contract metric and documented extra is shown", () => {
    const used = new Set();
    for (const [, e] of exprs) {
      for (const s of promqlRefs(e).selectors) used.add(s.name.replace(/_(bucket|sum|count)$/, ""));
    }
    return [...shown.keys()].filter((n) => !used.has(n)).map((n) => `${n} is on no panel`);
  });
}

// ------------------------------------------------------------------ main
const images = await dockerfileChecks();
const rendered = fs.readdirSync(renderedDir).filter((f) => f.endsWith(".yaml")).sort();
for (const f of rendered) {
  const name = f.replace(/\.yaml$/, "");
  const docs = parseAllDocuments(fs.readFileSync(path.join(renderedDir, f), "utf8"));
  const errors = docs.flatMap((d) => d.errors.map((e) => e.message));
  if (errors.length) {
    await check(`${name}: rendered YAML parses`, () => errors);
    continue;
  }
  await overlayChecks(name, docs.map((d) => d.toJS()).filter(Boolean), images);
}
await metricChecks();
process.exit(failures ? 1 : 0);
