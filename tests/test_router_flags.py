"""The router's flags: `splitserve serve` and `splitserve router` take the same
ones and build the same RouterConfig from them (router/flags.py)."""

from __future__ import annotations

import argparse

import pytest

from splitserve.cli import build_parser
from splitserve.router.config import Limits, Listeners, RouterConfig, RoutingConfig
from splitserve.router.flags import router_config_from_args

ROUTER_FLAGS = [
    "--host",
    "127.0.0.1",
    "--grpc-port",
    "6000",
    "--http-port",
    "-1",
    "--metrics-port",
    "9400",
    "--mode",
    "colocated",
    "--block-size",
    "32",
    "--local-prefill-max-tokens",
    "64",
    "--prefill-backlog-tokens",
    "700",
    "--max-inflight",
    "12",
    "--api-key",
    "k",
]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(list(argv)).parse_args(list(argv))


def test_serve_and_router_build_the_same_config_from_the_same_flags() -> None:
    served = router_config_from_args(parse("serve", *ROUTER_FLAGS), "token")
    alone = router_config_from_args(parse("router", "--decode", "d:1", *ROUTER_FLAGS), "token")
    assert (
        served
        == alone
        == RouterConfig(
            limits=Limits(max_inflight=12),
            listeners=Listeners(
                host="127.0.0.1", grpc_port=6000, http_port=None, metrics_port=9400, api_key="k", cluster_token="token"
            ),
            routing=RoutingConfig(
                mode="colocated", block_size=32, local_prefill_max_tokens=64, prefill_backlog_tokens=700
            ),
        )
    )


def test_the_flags_defaults_are_the_configs() -> None:
    cfg = router_config_from_args(parse("router", "--decode", "d:1", "--api-key", ""), None)
    assert cfg.routing == RoutingConfig()
    lis = cfg.listeners
    assert (lis.host, lis.grpc_port, lis.metrics_port, lis.http_port) == ("127.0.0.1", 50051, 0, 8000)
    assert cfg.limits == RouterConfig().limits


def test_the_router_command_reads_its_cluster_token_flag() -> None:
    a = parse("router", "--decode", "d:1", "--cluster-token", "secret")
    assert router_config_from_args(a, a.cluster_token).listeners.auth_metadata == (("x-splitserve-token", "secret"),)


def test_the_worker_flags_build_the_engine_config() -> None:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.flags import engine_config_from_args
    from splitserve.engine.tuned import detect_machine, tuned_defaults

    a = parse("worker", "--role", "decode", "--max-num-batched-tokens", "256", "--long-prefill-token-threshold", "64")
    tuned = tuned_defaults(detect_machine())  # the dtype no flag gave: the machine's arithmetic decides
    assert engine_config_from_args(a) == EngineConfig(
        dtype=tuned.dtype,
        quantization=tuned.quantization,
        max_num_batched_tokens=256,
        long_prefill_token_threshold=64,
        speculative="auto",
        itl_target="auto",  # a worker's flag default; an engine built in code is "off"
    )
    # no flags: the EngineConfig's own defaults, but for what the machine is tuned to (issue 22)
    assert engine_config_from_args(parse("worker", "--role", "prefill")) == EngineConfig(
        dtype=tuned.dtype,
        quantization=tuned.quantization,
        long_prefill_token_threshold=tuned.long_prefill_token_threshold,
        speculative="auto",
        itl_target="auto",
    )
    # speculation: auto on a CPU (bench/results/spec-cpu.txt), off on CUDA unless asked for, and its flags
    assert engine_config_from_args(parse("worker", "--role", "decode", "--device", "cuda")).speculative == "off"
    flags = ("--speculative", "ngram", "--num-speculative-tokens", "6", "--ngram-min", "1", "--ngram-max", "3")
    spec = engine_config_from_args(parse("worker", "--role", "decode", *flags))
    assert (spec.speculative, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max) == ("ngram", 6, 1, 3)


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (("--ssl-keyfile", "k.pem"), "--ssl-certfile and --ssl-keyfile go together"),
        (("--ssl-ca-certs", "ca.pem"), "--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile"),
        (("--ssl-certfile", "/no/such.pem", "--ssl-keyfile", "/no/such-key.pem"), "cannot read it"),
    ],
)
def test_tls_flags_that_do_not_go_together_are_refused_by_name(flags: tuple[str, ...], error: str) -> None:
    from splitserve.router.flags import tls_from_args

    with pytest.raises(ValueError, match=error):
        tls_from_args(parse("router", "--decode", "d:1", *flags))
