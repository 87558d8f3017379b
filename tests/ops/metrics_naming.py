#!/usr/bin/env python3
"""Checks a /metrics scrape against the naming rules attnserve keeps
(Prometheus' naming guide, and the conventions of the official client
libraries' process collectors):

  python3 tests/ops/metrics_naming.py SCRAPE [--fresh]

  - every family has HELP and TYPE, and its name is attnserve_* or process_*;
  - counters, and only counters, end in _total;
  - base units only: _seconds and _bytes, never milli/micro/kilo units or
    percents, and no family counts "tokens" (the server counts query rows);
  - no label value is "total" or "sum" (a sum over such a label means
    nothing), and no value of a label extends another one with "_"
    (kernel="attention" beside kernel="attention_decode" reads as a part of
    it, and a sum over the label counts it twice);
  - the standard process series are there: process_cpu_seconds_total,
    process_resident_memory_bytes, process_virtual_memory_bytes,
    process_open_fds, process_max_fds, process_start_time_seconds;
  - with --fresh (a scrape of a server nobody has called yet): the per-tenant
    families exist for the tenant "default", at 0.

Prints one line per rule broken and exits 1 if any is.
"""
import re
import sys

NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
PROCESS = ("process_cpu_seconds_total", "process_resident_memory_bytes",
           "process_virtual_memory_bytes", "process_open_fds", "process_max_fds",
           "process_start_time_seconds")
PER_TENANT = ("attnserve_tenant_kv_pages", "attnserve_tenant_regions",
              "attnserve_tenant_region_bytes", "attnserve_open_channels")
BAD_UNITS = re.compile(r"_(ms|us|ns|millis|milliseconds|microseconds|nanoseconds|minutes|hours|"
                       r"kb|mb|gb|kib|mib|gib|percent|ratio_percent)(_|$)")


def parse(text):
    """{family: {"type", "help", "samples": [(name, labels dict, value)]}}."""
    families = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, kind, name, rest = (line.split(" ", 3) + [""])[:4]
            families.setdefault(name, {"samples": []})[kind.lower()] = rest
            continue
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        if not m:
            families.setdefault("?", {"samples": []})["samples"].append((line, {}, ""))
            continue
        name, labels, value = m.group(1), dict(LABEL.findall(m.group(2) or "")), m.group(3)
        family = next((f for f in (name, re.sub(r"_(bucket|sum|count)$", "", name))
                       if f in families), name)
        families.setdefault(family, {"samples": []})["samples"].append((name, labels, value))
    return families


def problems(families, fresh):
    out = []
    for name, f in sorted(families.items()):
        if name == "?":
            out += [f"a line that is not a sample: {s[0]!r}" for s in f["samples"]]
            continue
        kind = f.get("type")
        if not NAME.match(name) or not (name.startswith("attnserve_") or name.startswith("process_")):
            out.append(f"{name}: not an attnserve_* or process_* name")
        if kind is None or "help" not in f:
            out.append(f"{name}: no TYPE or no HELP")
        if (kind == "counter") != name.endswith("_total"):
            out.append(f"{name}: a {kind} {'without' if kind == 'counter' else 'with'} _total")
        if BAD_UNITS.search(name):
            out.append(f"{name}: not in base units (seconds, bytes)")
        if "token" in name:
            out.append(f"{name}: counts tokens? the server counts query rows")
        values = {}
        for _, labels, _ in f["samples"]:
            for label, value in labels.items():
                if label != "le":
                    values.setdefault(label, set()).add(value)
        for label, vals in sorted(values.items()):
            for v in sorted(vals):
                if v in ("total", "sum"):
                    out.append(f'{name}{{{label}="{v}"}}: a sum over {label} means nothing')
                for w in vals:
                    if w != v and w.startswith(v + "_"):
                        out.append(f'{name}: {label}="{w}" extends {label}="{v}": values must be '
                                   "disjoint, so that a sum over the label counts each once")
    for name in PROCESS:
        if name not in families:
            out.append(f"{name}: missing (the standard process series)")
    if fresh:
        for name in PER_TENANT:
            got = [v for _, labels, v in families.get(name, {"samples": []})["samples"]
                   if labels.get("tenant") == "default"]
            if got != ["0"]:
                out.append(f'{name}{{tenant="default"}}: {got or "absent"} on a fresh server, '
                           "want 0")
    return out


def main():
    text = open(sys.argv[1]).read()
    found = problems(parse(text), "--fresh" in sys.argv[2:])
    for p in found:
        print(p)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
