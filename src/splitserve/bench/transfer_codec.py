"""`splitserve bench transfer --codec`: the KV wire codec's bytes and TTFT, on loopback and on a
link throttled to 1 Gb/s, side by side in one run.

For each link (loopback, and a userspace TCP proxy in this process that paces the sender's
bytes to `--link-gbps`: no root, no `tc`, the same on any CI machine) and each codec mode
(`raw`, `auto`, `int8`), a fresh KVSender sends `--prompts` prompts of `--prompt-tokens`
tokens of the default model's KV shape (SmolLM2-135M: 30 layers, 3 KV heads of 64,
bfloat16) through KVReceiver, after `--warm-up` untimed ones (with them `auto` measures the
link: its first stream goes raw). Each prompt is a model-shaped prefill: for every layer a
stand-in compute of `--layer-ms` (a sleep, so that it takes no core from the transfer: it
stands for a GPU's prefill, about 2 ms a layer for 2K tokens; this CPU's own prefill of a
2K-token prompt takes seconds and hides any link), then `send_layer`, with the stream's
back-pressure as in a worker. Figures, medians over the timed prompts:

- TTFT: from opening the stream to the last layer handed to the stream (the prefill worker
  samples the first token then and returns it: what the client sees; a slow link holds it
  back through the bounded send queue);
- KV ready: to the receiver's confirmation of every byte (when the decode worker can go on);
- the wire bytes of one prompt, and what `auto` chose and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import statistics
import threading
import time

import torch

from splitserve.engine.kv_cache import KVCache, KVLayout
from splitserve.kv_transfer import KVReceiver, KVSender, KVStream, codec
from splitserve.measure.hw import machine_line

PROXY_CHUNK = 64 << 10
PROXY_RCVBUF = 256 << 10  # the proxy's socket buffer: a NIC's queue, not a second sender buffer


class PacedProxy:
    """A TCP proxy on 127.0.0.1 to `upstream`, pacing the client-to-upstream direction to
    `gbps` (a token bucket with no credit beyond one chunk; inf: no pacing); the other direction
    unpaced. `tap`: where to keep a copy of every byte of the paced direction (what a reader on
    the path sees)."""

    def __init__(self, upstream: tuple[str, int], gbps: float, tap: bytearray | None = None) -> None:
        self.rate = gbps * 1e9 / 8
        self.upstream = upstream
        self.tap = tap
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="paced-proxy").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, PROXY_RCVBUF)
            up = socket.create_connection(self.upstream)
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [client, up]
            threading.Thread(target=self._pipe, args=(client, up, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        buf = bytearray(PROXY_CHUNK)
        ready = time.perf_counter()
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                if paced:
                    now = time.perf_counter()
                    ready = max(ready, now)
                    if ready > now:
                        time.sleep(ready - now)
                    ready += n / self.rate
                    if self.tap is not None:
                        self.tap += buf[:n]
                dst.sendall(memoryview(buf)[:n])
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._socks:
            s.close()


@dataclasses.dataclass
class Figures:
    ttft: list[float] = dataclasses.field(default_factory=list)
    kv_ready: list[float] = dataclasses.field(default_factory=list)
    wire_bytes: int = 0
    codecs: set[str] = dataclasses.field(default_factory=set)
    model: str = ""  # the cost model on the measured link, without the same-host rule


def _prompt(
    tx: KVSender, rx: KVReceiver, r_ids: list[int], src_ids: list[int], via: int | None, layer_s: float
) -> tuple[float, float, KVStream]:
    r = rx.reserve(f"p{time.monotonic_ns()}", r_ids, lease_s=60)
    if via is not None:  # through the proxy
        r = dataclasses.replace(r, tcp_endpoint=f"127.0.0.1:{via}", endpoint=f"127.0.0.1:{via}")
    t0 = time.perf_counter()
    with tx.open(r) as stream:
        for layer in range(r.layout.num_layers):
            time.sleep(layer_s)  # the layer's compute, standing for a GPU's
            stream.send_layer(layer, src_ids)
        t_first = time.perf_counter()
        stream.finish(1, timeout=60)
        t_kv = time.perf_counter()
    return t_first - t0, t_kv - t0, stream


def _scenario(
    src: KVCache, rx: KVReceiver, mode: codec.WireCodecMode, via: int | None, args: argparse.Namespace
) -> Figures:
    """One link and codec mode: a fresh sender (`auto` measures the link anew), its prompts."""
    ids = list(range(args.prompt_tokens // src.layout.block_size))
    tx = KVSender(src, wire_codec=mode, same_host_raw=via is None)  # the proxy stands for a remote link
    f = Figures()
    try:
        for i in range(args.warm_up + args.prompts):
            ttft, kv, stream = _prompt(tx, rx, ids, ids, via, (args.layer_ms or 2.0) / 1000)
            if i >= args.warm_up:
                f.ttft.append(ttft)
                f.kv_ready.append(kv)
                f.wire_bytes = stream.wire_bytes
                f.codecs.add(codec.CODEC_NAMES[stream.codec])
        if mode == "auto":
            bw = tx.link_bps(("tcp", f"127.0.0.1:{via}" if via is not None else rx.tcp_endpoint))
            ratio = codec.ratio(codec.CODEC_INT8, src.layout.head_dim, src.layout.torch_dtype.itemsize)
            f.model = codec.choose(bw, tx.speed(), ratio).why
    finally:
        tx.close()
    return f


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, args.block_size, args.dtype)
    blocks = args.prompt_tokens // layout.block_size
    src = KVCache(layout, blocks)
    src.tensor.copy_(torch.randn(src.tensor.shape).to(src.tensor.dtype))
    dst = KVCache(layout, blocks)
    raw_bytes = layout.num_layers * blocks * layout.bytes_per_block
    speed = codec.measure_speed(layout.torch_dtype, layout.head_dim)
    print(
        f"# splitserve bench transfer --codec --layers {args.layers} --kv-heads {args.kv_heads} --head-dim "
        f"{args.head_dim} --dtype {args.dtype} --prompt-tokens {args.prompt_tokens} --layer-ms {args.layer_ms or 2.0} "
        f"--link-gbps {args.link_gbps} --prompts {args.prompts} --warm-up {args.warm_up}"
    )
    print(machine_line())
    print(
        f"one prompt: {args.prompt_tokens} tokens, {layout.num_layers} layers x {blocks} blocks of "
        f"{layout.bytes_per_block} B ({layout.dtype}, {layout.num_kv_heads} KV heads x {layout.head_dim}, block "
        f"{layout.block_size}) = {raw_bytes / 2**20:.1f} MiB raw; stand-in compute {args.layer_ms or 2.0} ms a layer; "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"int8 codec speed measured at start (one core, {layout.dtype} bytes in): encode "
        f"{speed.encode_bps / 1e9:.2f} GB/s, decode {speed.decode_bps / 1e9:.2f} GB/s"
    )
    rx = KVReceiver(dst)
    proxy = PacedProxy(("127.0.0.1", int(rx.tcp_endpoint.rpartition(":")[2])), args.link_gbps)
    results: dict[tuple[str, str], Figures] = {}
    try:
        for link, via in (("loopback", None), (f"{args.link_gbps:g} Gb/s", proxy.port)):
            for mode in ("raw", "auto", "int8"):
                results[(link, mode)] = _scenario(src, rx, mode, via, args)
    finally:
        proxy.close()
        rx.close()
    print(
        f"\nmedians over {args.prompts} prompts after {args.warm_up} warm-up ones; TTFT: the stream opened -> the "
        "last layer handed to it (the first token); KV ready: -> the receiver confirmed every byte"
    )
    print(
        f"  {'link':10s} {'codec':6s} {'sent as':8s} {'MiB/prompt':>10s} {'x raw':>6s} {'TTFT ms':>8s} "
        f"{'KV ready ms':>11s}  TTFT vs raw"
    )
    for (link, mode), f in results.items():
        base = results[(link, "raw")]
        ttft, kv = statistics.median(f.ttft), statistics.median(f.kv_ready)
        change = (ttft / statistics.median(base.ttft) - 1) * 100
        print(
            f"  {link:10s} {mode:6s} {'/'.join(sorted(f.codecs)):8s} {f.wire_bytes / 2**20:10.2f} "
            f"{f.wire_bytes / raw_bytes:6.3f} {ttft * 1e3:8.1f} {kv * 1e3:11.1f}  {change:+.1f}%"
        )
    print(
        "\nauto after its warm-up: the cost model (codec.choose) on the link it measured, the codec's speed "
        "measured when first needed"
    )
    for (link, mode), f in results.items():
        if mode == "auto":
            if link == "loopback":  # the proxy's link is the only one exempt from the rule
                print(f"  {link:10s} raw: the receiver is on this host (codec.choose's same_host, before bandwidth)")
                print(f"  {'':10s} (on the measured bandwidth alone: {f.model})")
            else:
                print(f"  {link:10s} {f.model}")
    slow = f"{args.link_gbps:g} Gb/s"
    cut = 1 - statistics.median(results[(slow, "auto")].ttft) / statistics.median(results[(slow, "raw")].ttft)
    ratio = results[(slow, "int8")].wire_bytes / raw_bytes
    loop_auto = results[("loopback", "auto")]
    print(
        f"\nint8 bytes per prompt {ratio:.3f}x raw (target <= 0.55: {'ok' if ratio <= 0.55 else 'MISSED'}); "
        f"TTFT at {slow} with auto {cut * 100:.0f}% lower than raw "
        f"(target >= 30%: {'ok' if cut >= 0.30 else 'MISSED'}); "
        f"loopback auto sent {'/'.join(sorted(loop_auto.codecs))} "
        f"({'ok' if loop_auto.codecs == {'raw'} else 'MISSED'}: the cost model keeps it off)"
    )
    return 0
