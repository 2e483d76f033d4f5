"""``attnsdk explain``: can the configured backend serve this model's attention, and if not, why.

The model shape comes from flags or a ``--layer`` file (JSON, TOML or YAML) holding
``LayerSpec`` and ``KVCacheLayout`` fields by name; flags override the file. The answer is
``attnsdk.explain`` for every candidate backend plus the one ``create_backend`` would pick.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnsdk._cli.info import config_json, reason_json, reason_text, render_config, selected
from attnsdk.contract.device import cuda_available
from attnsdk.contract.errors import InvalidInputError
from attnsdk.contract.kv import KVCacheLayout
from attnsdk.contract.layer import LayerSpec
from attnsdk.selection.config import AttentionConfig, ConfigSource, config_in_effect
from attnsdk.selection.config_files import read_mapping
from attnsdk.selection.create import explain
from attnsdk.selection.registry import AUTO

if TYPE_CHECKING:
    import argparse

__all__ = ["DTYPES", "SHAPE_FIELDS", "dtype_name", "parse_dtype", "run_explain"]

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
}
"""dtype names ``--dtype`` / ``--kv-dtype`` and layer files accept (also with a ``torch.`` prefix)."""

_LAYER = [f.name for f in dataclasses.fields(LayerSpec)]
_LAYOUT = [f.name for f in dataclasses.fields(KVCacheLayout)]
SHAPE_FIELDS = tuple(dict.fromkeys([*_LAYER, *_LAYOUT]))
"""Keys of a ``--layer`` file; ``num_kv_heads``, ``head_dim`` and ``v_head_dim`` are shared."""
_DEFAULTS: dict[str, Any] = {"page_size": 16, "dtype": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``; an unknown name raises ``ValueError`` listing them."""
    dtype = DTYPES.get(name.strip().lower().removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; one of: {', '.join(DTYPES)}")
    return dtype


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def run_explain(args: argparse.Namespace) -> int:
    """Print the answer; 0 when the backend ``create_backend`` would pick can serve the shape."""
    config, source = _config(args)
    layer, layout = _shape(args)
    device = args.device or ("cuda" if cuda_available() else "cpu")
    reasons = explain(config, layer, layout, device=device)
    chosen = selected(reasons)
    report = {
        "config": config_json(config, source),
        "device": device,
        "layer": dataclasses.asdict(layer),
        "layout": {
            **dataclasses.asdict(layout),
            "dtype": dtype_name(layout.dtype),
            "kv_dtype": dtype_name(layout.kv_dtype),
            "order": layout.kv_order.value,
        },
        "backends": [
            {"name": n, "can_serve": not rs, "reasons": [reason_json(r) for r in rs]}
            for n, rs in reasons.items()
        ],
        "chosen": chosen,
        "ok": chosen is not None and not reasons[chosen],
    }
    print(json.dumps(report, indent=2) if args.json else _render(report))
    return 0 if report["ok"] else 1


def _config(args: argparse.Namespace) -> tuple[AttentionConfig, ConfigSource]:
    if args.backend is not None:
        return AttentionConfig(backend=args.backend), ConfigSource("--backend", args.backend)
    if args.config is not None:
        return AttentionConfig.from_file(args.config), ConfigSource("--config", args.config)
    return config_in_effect()


def _shape(args: argparse.Namespace) -> tuple[LayerSpec, KVCacheLayout]:
    """LayerSpec and KVCacheLayout from the ``--layer`` file, then the flags, then defaults."""
    values: dict[str, Any] = {}
    where = "the command line"
    if args.layer is not None:
        values = _layer_file(Path(args.layer))
        where = f"layer file {args.layer!r} and the command line"
    values.update({k: getattr(args, k) for k in SHAPE_FIELDS if getattr(args, k, None) is not None})
    for name in ("num_heads", "head_dim"):
        if name not in values:
            flag = "--heads" if name == "num_heads" else "--head-dim"
            raise InvalidInputError(name, f"{flag} or {name!r} in a --layer file", "nothing")
    values.setdefault("num_kv_heads", values["num_heads"])
    values = {**_DEFAULTS, **values}
    try:
        layer = LayerSpec(**{k: v for k, v in values.items() if k in _LAYER})
        layout = KVCacheLayout(**{k: v for k, v in values.items() if k in _LAYOUT})
    except InvalidInputError as exc:
        hint = f"{exc.hint}. From {where}" if exc.hint else f"From {where}"
        raise InvalidInputError(exc.field, exc.expected, exc.found, hint) from None
    return layer, layout


def _layer_file(path: Path) -> dict[str, Any]:
    data = read_mapping(path, "layer file")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in SHAPE_FIELDS:
            close = difflib.get_close_matches(key, SHAPE_FIELDS, n=1)
            hint = f"Did you mean {close[0]!r}? " if close else ""
            raise InvalidInputError(
                key,
                f"a LayerSpec or KVCacheLayout field: {', '.join(SHAPE_FIELDS)}",
                f"unknown key {key!r}",
                f"{hint}In layer file {str(path)!r}",
            )
        if key in ("dtype", "kv_dtype") and isinstance(value, str):
            try:
                value = parse_dtype(value)
            except ValueError as exc:
                raise InvalidInputError(key, "a dtype name", repr(value), str(exc)) from None
        values[key] = value
    return values


def _render(report: dict[str, Any]) -> str:
    layer, layout = report["layer"], report["layout"]
    window = layer["sliding_window"]
    lines = [
        *render_config(report["config"]),
        f"layer    Hq={layer['num_heads']} Hkv={layer['num_kv_heads']} D={layer['head_dim']} "
        f"Dv={layer['v_head_dim'] or layer['head_dim']}, "
        f"{'causal' if layer['causal'] else 'non-causal'}, "
        f"window {window or 'off'}, softcap {layer['softcap'] or 'off'}, "
        f"sinks {'on' if layer['has_sinks'] else 'off'}, "
        f"chunks {layer['attention_chunk_size'] or 'off'}"
        + (", MLA (latent cache)" if layer["mla"] else ""),
        f"layout   page_size {layout['page_size']}, dtype {layout['dtype']}, "
        f"kv_dtype {layout['kv_dtype'] or layout['dtype']}, order {layout['order']}",
        f"device   {report['device']}",
        "candidates (in the order they are tried):"
        if report["config"]["backend"] == AUTO
        else "backend:",
    ]
    for b in report["backends"]:
        lines.append(f"  {b['name']:<12} {'can serve' if b['can_serve'] else 'cannot serve'}")
        lines += [f"      - {reason_text(r)}" for r in b["reasons"]]
    lines.append(f"result   {_verdict(report)}")
    return "\n".join(lines)


def _verdict(report: dict[str, Any]) -> str:
    chosen, backend = report["chosen"], report["config"]["backend"]
    able = [b["name"] for b in report["backends"] if b["can_serve"]]
    if backend != AUTO:
        return f"{backend} {'can' if report['ok'] else 'cannot'} serve this layer here"
    if chosen is None:
        return "auto finds no backend that can run here"
    if report["ok"]:
        return f"auto picks {chosen}, which can serve this layer"
    others = f"; backends that can: {', '.join(able)} (pass --backend)" if able else ""
    return f"auto picks {chosen}, which cannot serve this layer{others}"
