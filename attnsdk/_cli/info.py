"""``attnsdk info``: versions, the device, every backend's availability, the FA3 kernel package it
would load, the engine adapters' tested releases and the config in effect.

The report is one JSON-ready dict (``attnsdk info --json`` prints it; docs/cli.md lists its
keys); the text form is rendered from the same dict. Nothing here imports a kernel library.
"""

from __future__ import annotations

import json
import platform
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.backends.fa3.kernels import PROVIDERS, find_provider, module_present
from attnsdk.contract.device import compute_capability, cuda_available, device_name
from attnsdk.contract.errors import AttnSDKError, Reason, ReasonKind
from attnsdk.selection.config import AttentionConfig, ConfigSource, config_in_effect
from attnsdk.selection.create import explain
from attnsdk.selection.debug import debug_enabled
from attnsdk.selection.registry import AUTO, backend_names

if TYPE_CHECKING:
    from attnsdk.adapters._common import EngineVersions

__all__ = [
    "config_json",
    "info_report",
    "reason_json",
    "reason_text",
    "render_config",
    "render_info",
    "run_info",
    "selected",
]


def run_info(as_json: bool) -> int:
    """Print the report; 0 when the config in effect selects a backend that can run here."""
    report = info_report()
    print(json.dumps(report, indent=2) if as_json else render_info(report))
    return 0 if report["config"]["selected"] else 1


def info_report() -> dict[str, Any]:
    from attnsdk import __version__

    cc = compute_capability()
    device = "cuda" if cuda_available() else "cpu"
    try:
        config, source = config_in_effect()
        config_part = config_json(config, source)
        config_part["selected"] = selected(explain(config, device=device))
    except AttnSDKError as exc:  # a broken config is reported with everything else
        config, config_part = None, {"error": str(exc)}
    # Every registered backend, composites such as "routed" too (explain("auto") lists only
    # what "auto" may pick).
    every = {n: explain(n, device=device)[n] for n in backend_names()}
    return {
        "attnsdk": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": {
            "type": device,
            "name": device_name(),
            "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
        },
        "config": {**dict.fromkeys(_CONFIG_KEYS), **config_part},
        "backends": [
            {"name": name, "available": not reasons, "reasons": [reason_json(r) for r in reasons]}
            for name, reasons in every.items()
        ],
        "fa3_kernel": _fa3_kernel(config),
        "engines": [
            {"package": v.package, "tested": list(v.tested), "installed": v.installed()}
            for v in _engine_versions()
        ],
    }


_CONFIG_KEYS = ("backend", "options", "debug", "source", "selected", "error")


def config_json(config: AttentionConfig, source: ConfigSource) -> dict[str, Any]:
    """The config's JSON form, with where it came from and the effective debug switch."""
    return {
        "backend": config.backend,
        "options": config.options.model_dump(mode="json"),
        "debug": debug_enabled(config),
        "source": {"kind": source.kind, "value": source.value, "text": str(source)},
    }


def reason_json(reason: Reason) -> dict[str, str]:
    return {"kind": reason.kind.name.lower(), "field": reason.field, "message": reason.message}


def selected(reasons: dict[str, list[Reason]]) -> str | None:
    """The backend ``create_backend`` would create, given ``explain``'s answer for a config: the
    first candidate that can run here (an explicit backend is the only candidate)."""
    runs = (n for n, rs in reasons.items() if all(r.kind is not ReasonKind.ENVIRONMENT for r in rs))
    return next(runs, None)


def _fa3_kernel(config: AttentionConfig | None) -> dict[str, Any]:
    """Which FA3 kernel package the fa3 backend would load: found by path, never imported."""
    from attnsdk.backends.fa3 import FA3Options  # imports no kernel library

    options = config.options if config is not None else None
    wanted = options.provider if isinstance(options, FA3Options) else "auto"
    provider = find_provider(wanted)
    return {
        "requested": wanted,
        "provider": provider,
        "module": PROVIDERS[provider] if provider else None,
        "installed": {name: module_present(module) for name, module in PROVIDERS.items()},
    }


def _engine_versions() -> list[EngineVersions]:
    from attnsdk.adapters.sglang import SGLANG_VERSIONS
    from attnsdk.adapters.vllm import VLLM_VERSIONS

    return [SGLANG_VERSIONS, VLLM_VERSIONS]


def render_info(report: dict[str, Any]) -> str:
    dev = report["device"]
    cc = dev["compute_capability"]
    lines = [
        f"attnsdk  {report['attnsdk']}",
        f"python   {report['python']}",
        f"torch    {report['torch']}",
        f"device   {dev['name']}" + (f" (compute capability {cc})" if cc else " (no CUDA GPU)"),
        *render_config(report["config"]),
    ]
    cfg = report["config"]
    if cfg["selected"]:
        lines.append(f"         selects {cfg['selected']} on {dev['type']}")
    elif not cfg["error"]:
        which = "no candidate" if cfg["backend"] == AUTO else cfg["backend"]
        lines.append(f"         selects nothing: {which} can run on {dev['type']}")
    lines.append(f"backends on {dev['type']} (highest priority first):")
    for b in report["backends"]:
        lines.append(f"  {b['name']:<12} {'available' if b['available'] else 'unavailable'}")
        lines += [f"      - {reason_text(r)}" for r in b["reasons"]]
    fa3 = report["fa3_kernel"]
    found = [name for name, present in fa3["installed"].items() if present]
    looked = ", ".join(
        PROVIDERS[p] for p in ([fa3["requested"]] if fa3["requested"] != AUTO else PROVIDERS)
    )
    lines.append(
        f"fa3 kernel  {fa3['module']} (provider {fa3['provider']}; installed: {', '.join(found)})"
        if fa3["provider"]
        else f"fa3 kernel  none found (looked for {looked})"
    )
    lines.append("engine adapters (tested releases; make test-engines):")
    for e in report["engines"]:
        span = f"{e['tested'][0]} .. {e['tested'][-1]}"
        lines.append(f"  {e['package']:<12} {span}, installed: {e['installed'] or 'no'}")
    return "\n".join(lines)


def render_config(cfg: dict[str, Any]) -> list[str]:
    """The ``config`` lines of ``info`` and ``explain``."""
    if cfg.get("error"):
        return [
            f"config   error: {line}" if i == 0 else f"         {line}"
            for i, line in enumerate(cfg["error"].splitlines())
        ]
    options = json.dumps(cfg["options"])
    return [
        f"config   {cfg['backend']}, from {cfg['source']['text']}",
        f"         options {options}, debug {'on' if cfg['debug'] else 'off'}",
    ]


def reason_text(reason: dict[str, str]) -> str:
    """A ``reason_json`` as ``str(Reason)`` prints it."""
    return f"{reason['kind']}: {reason['field']} {reason['message']}"
