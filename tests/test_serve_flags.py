"""`splitserve serve`'s per-pool tensor-parallel sizes: each pool's own flag or the shared one,
and a pool whose ranks would need GPUs Ray did not give it refused before Ray starts."""

from __future__ import annotations

import pytest

from splitserve.cli import build_parser, main
from splitserve.cluster.serve import check_pool_tp, pool_tp_size

pytestmark = pytest.mark.timeout(60)


def _serve(*flags: str):
    argv = ["serve", *flags]
    return build_parser(argv).parse_args(argv)


def test_each_pool_takes_its_own_size_or_the_shared_one():
    a = _serve("--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1")
    assert (pool_tp_size(a, "prefill"), pool_tp_size(a, "decode")) == (2, 1)
    assert (pool_tp_size(_serve(), "prefill"), pool_tp_size(_serve(), "decode")) == (1, 1)


def test_a_cuda_pool_with_fewer_gpus_than_ranks_is_refused_before_ray_starts(capsys):
    rc = main(["serve", "--device", "cuda", "--prefill-tensor-parallel-size", "2", "--gpus-per-worker", "1"])
    assert rc == 2
    assert "prefill workers at tensor-parallel size 2 need 2 GPUs each: --gpus-per-worker is 1" in (
        capsys.readouterr().err
    )
    check_pool_tp("decode", 4, "cuda:0", 4.0)  # enough
    check_pool_tp("decode", 4, "cpu", 0.0)  # ranks on a CPU share its cores: no GPU asked
    with pytest.raises(ValueError, match="at least 1"):
        check_pool_tp("decode", 0, "cpu", 0.0)


def test_a_bad_router_flag_is_refused_before_ray_starts(capsys):
    """The router's own flags are read with the rest: a negative port used to end in a traceback from
    inside the running cluster, after Ray and both pools had started."""
    assert main(["serve", "--metrics-port", "-1"]) == 2
    assert "metrics_port must be >= 0, got -1" in capsys.readouterr().err


def test_switch_roles_makes_every_worker_switchable_and_needs_pools_that_match(capsys):
    from splitserve.cluster.serve import configure, pool_specs, with_tuned

    for flags, switchable in (("--scaling joint --prefill-workers-max 3 --switch-roles", True), ("", False)):
        a, _ = with_tuned(_serve(*flags.split()))
        cfg = configure(a)
        assert cfg.switch_roles is switchable
        assert [s.worker.switchable for s in pool_specs(a, cfg, 1.0, "token", None)] == [switchable] * 2
    assert main(["serve", "--switch-roles"]) == 2
    assert "give --scaling joint" in capsys.readouterr().err
    flags = "--scaling joint --prefill-workers-max 3 --switch-roles --decode-tensor-parallel-size 2"
    assert main(["serve", *flags.split()]) == 2
    assert "the pools' must match" in capsys.readouterr().err
