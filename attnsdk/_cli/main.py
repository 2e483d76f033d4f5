"""The ``attnsdk`` command (also ``python -m attnsdk``): ``info``, ``explain``, ``demo``, ``bench``.

Help strings are written for a terminal (argparse prints them as they are); docs/cli.md is the
manual. Exit codes: 0 success, 1 the answer is "no" (nothing can run, or the backend cannot serve
the shape), 2 a usage or configuration error (a message on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import os
import sys

from attnsdk.contract.errors import AttnSDKError

__all__ = ["build_parser", "main"]

_EPILOG = """\
configuration (first one set wins):
  ATTNSDK_CONFIG     a config file (.json, .toml, .yaml)
  ATTNSDK_BACKEND    a backend name (any case), with default options
  [tool.attnsdk]     in the nearest pyproject.toml
  otherwise "auto": the highest-priority backend that can run here

exit status: 0 ok, 1 the answer is no, 2 usage or configuration error
manual: docs/cli.md"""


def build_parser(prog: str = "attnsdk") -> argparse.ArgumentParser:
    from attnsdk import __version__

    parser = argparse.ArgumentParser(
        prog=prog,
        description="attnsdk: one paged-attention contract, many kernel backends.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"attnsdk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser(
        "info",
        help="versions, device, every backend's availability, the config in effect",
        description="Print attnsdk's version, Python and torch, the device, whether each "
        "backend can run here and why not, the FA3 kernel package the fa3 backend would load, "
        "the engine releases the adapters are tested on, and the config in effect. Exit status "
        "1 when that config selects no backend that can run here.",
    )
    info.add_argument("--json", action="store_true", help="print one JSON object")

    explain = sub.add_parser(
        "explain",
        help="can the configured backend serve a model's attention shape, and if not, why",
        description="Check a model's attention shape against every candidate backend of a "
        "config and print each reason a backend cannot serve it. Exit status 0 when the backend "
        "the config selects can serve it, 1 when not, 2 for a usage error.",
    )
    which = explain.add_mutually_exclusive_group()
    which.add_argument("--backend", metavar="NAME", help="a backend name or auto")
    which.add_argument("--config", metavar="FILE", help="a config file (.json, .toml, .yaml)")
    explain.add_argument(
        "--device", help="device to check, e.g. cpu, cuda, cuda:1 (default: cuda if visible)"
    )
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    shape = explain.add_argument_group(
        "model shape",
        "From flags, or from a --layer file holding LayerSpec and KVCacheLayout fields by name "
        "(flags override the file). --heads and --head-dim are required.",
    )
    shape.add_argument("--layer", metavar="FILE", help="a .json, .toml or .yaml shape file")
    shape.add_argument("--heads", dest="num_heads", type=int, metavar="N", help="query heads")
    shape.add_argument(
        "--kv-heads", dest="num_kv_heads", type=int, metavar="N", help="KV heads (default: heads)"
    )
    shape.add_argument("--head-dim", dest="head_dim", type=int, metavar="D", help="QK head dim")
    shape.add_argument(
        "--v-head-dim", dest="v_head_dim", type=int, metavar="D", help="V head dim (default: D)"
    )
    shape.add_argument(
        "--window", dest="sliding_window", type=int, metavar="W", help="sliding window W tokens"
    )
    shape.add_argument(
        "--chunk",
        dest="attention_chunk_size",
        type=int,
        metavar="C",
        help="chunked local attention, chunks of C tokens",
    )
    shape.add_argument("--softcap", type=float, metavar="C", help="logit softcap C")
    shape.add_argument(
        "--sinks", dest="has_sinks", action="store_const", const=True, help="attention sinks"
    )
    shape.add_argument(
        "--non-causal", dest="causal", action="store_const", const=False, help="no causal mask"
    )
    shape.add_argument(
        "--mla",
        action="store_const",
        const=True,
        help="multi-head latent attention: --kv-heads 1, --head-dim kv_lora_rank + rope dim, "
        "--v-head-dim kv_lora_rank (DeepSeek: 576 and 512)",
    )
    shape.add_argument(
        "--page-size", dest="page_size", type=int, metavar="P", help="tokens per page (16)"
    )
    shape.add_argument("--dtype", type=_dtype, help="compute dtype (bfloat16)")
    shape.add_argument(
        "--kv-dtype", dest="kv_dtype", type=_dtype, metavar="DTYPE", help="cache dtype, e.g. fp8"
    )
    shape.add_argument("--order", choices=["NHD", "HND"], help="KV page order (NHD)")

    demo = sub.add_parser(
        "demo",
        help="run a mixed batch on the configured backend and check it against the reference",
        description="Run one mixed batch on the configured backend (default: the config in "
        "effect) and compare the output and the KV cache with the reference backend.",
    )
    demo.add_argument("--backend", metavar="NAME", help="backend name (default: config in effect)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (0)")

    bench = sub.add_parser(
        "bench",
        help="benchmark the backends that can run here against their raw kernels",
        description="Time decode, prefill and mixed steps (Llama-3-8B attention, bf16, page 16) "
        "on each backend that can run here and on its raw kernel, eager and under CUDA-graph "
        "replay, as ratios to each other and to floors measured in the same run; every output "
        "is checked against the reference backend. Without CUDA: a tiny CPU benchmark of the "
        "backends that run on a CPU. Exit status 1 when a backend fails or is wrong.",
    )
    bench.add_argument(
        "--backend",
        action="append",
        metavar="NAME[,NAME]",
        help="backends to run (repeatable; default: every backend auto may pick that runs here)",
    )
    bench.add_argument(
        "--suite",
        action="append",
        metavar="SUITE[,SUITE]",
        help="decode, prefill, mixed (repeatable; default: all three)",
    )
    bench.add_argument("--quick", action="store_true", help="a few cases, short timing loops")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument(
        "--out", metavar="DIR", help="also write bench.json and <suite>.json into DIR"
    )
    return parser


def main(argv: list[str] | None = None, *, prog: str = "attnsdk") -> int:
    """Run the command in ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            from attnsdk._cli.info import run_info

            return run_info(args.json)
        if args.command == "explain":
            from attnsdk._cli.explain import run_explain

            return run_explain(args)
        if args.command == "bench":
            from attnsdk._cli.bench import run_bench

            return run_bench(args)
        from attnsdk._cli.demo import demo

        return demo(args.backend, args.seed)
    except AttnSDKError as exc:  # a configuration problem is a message, not a traceback
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `attnsdk info | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _dtype(name: str) -> object:
    from attnsdk._cli.explain import parse_dtype

    try:
        return parse_dtype(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
