"""Registry: registering never activates, names are checked, "auto" and explicit selection, explain."""

from __future__ import annotations

import logging
import sys
import types
from importlib.metadata import EntryPoint
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import torch
from pydantic import BaseModel, ConfigDict

import attnsdk as A
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.contract.capabilities import capability_reasons
from attnsdk.selection import create as _create
from attnsdk.selection import registry as _registry

if TYPE_CHECKING:
    from collections.abc import Iterator

ENV = A.ReasonKind.ENVIRONMENT
CFG = A.ReasonKind.CONFIGURATION


@pytest.fixture(autouse=True)
def registry_state() -> Iterator[None]:
    """Every test starts from, and leaves behind, the registry as it found it."""
    saved = dict(_registry._REGISTRY)
    loaded = _registry._PLUGINS_LOADED
    logged = set(_create._LOGGED_AUTO)
    yield
    with _registry._LOCK:
        _registry._REGISTRY.clear()
        _registry._REGISTRY.update(saved)
        _registry._PLUGINS_LOADED = loaded
        _create._LOGGED_AUTO.clear()
        _create._LOGGED_AUTO.update(logged)


class Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    tile: int = 64


def make_backend(
    name: str,
    *,
    env: list[A.Reason] | None = None,
    max_head_dim: int = 256,
    created: list[Any] | None = None,
) -> type:
    """A backend class that records its constructions and reports ``env`` as its environment
    (it plans and attends like the reference backend, so it is a complete ``Backend``)."""

    class Fake(ReferenceBackend):
        capabilities: ClassVar[A.Capabilities] = A.Capabilities(
            devices=frozenset({"cpu", "cuda"}),
            dtypes=frozenset({torch.bfloat16}),
            kv_dtypes=frozenset(),
            max_head_dim=max_head_dim,
            features=frozenset({A.Feature.GQA}),
        )
        Options: ClassVar[type[BaseModel]] = globals()["Options"]

        def __init__(self, options: BaseModel) -> None:  # type: ignore[override]
            self.name = name  # type: ignore[misc]
            self.options = options  # type: ignore[assignment]
            if created is not None:
                created.append(options)

        @classmethod
        def environment_reasons(cls, device: Any = None) -> list[A.Reason]:  # type: ignore[override]
            return list(env or [])

        def unsupported_reasons(
            self,
            layer: Any = None,
            layout: Any = None,
            device: Any = None,
            *,
            uses: Any = (),
            dtype: Any = None,
        ) -> list[A.Reason]:
            cpu = torch.device("cpu")
            request = A.Request(layer, layout, cpu, uses=frozenset(uses), dtype=dtype)
            return self.environment_reasons(device) + capability_reasons(self.capabilities, request)

    Fake.__name__ = Fake.__qualname__ = f"Fake_{name}"
    return Fake


# --- register_backend --------------------------------------------------------------------------


def test_register_never_constructs_the_factory() -> None:
    calls: list[object] = []

    def factory(options: object) -> A.Backend:
        calls.append(options)
        return ReferenceBackend()

    A.register_backend("lazy", factory)
    assert "lazy" in A.backend_names()
    assert calls == []
    assert A.create_backend("lazy").name == "reference"
    assert len(calls) == 1


def test_capabilities_are_checked_without_constructing() -> None:
    created: list[object] = []
    A.register_backend("data-only", make_backend("data-only", created=created), priority=-1)
    layer = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64)
    assert A.explain("auto", layer, device="cpu")["data-only"] == []
    assert created == []


def test_register_by_path_imports_nothing_until_used() -> None:
    A.register_backend("by-path", "attnsdk_no_such_module_xyz:Backend")
    assert "by-path" in A.backend_names()
    assert "attnsdk_no_such_module_xyz" not in sys.modules


def test_registration_remove() -> None:
    handle = A.register_backend("temp", ReferenceBackend, priority=-5)
    assert repr(handle) == "Registration('temp')"
    assert "temp" in A.backend_names()
    handle.remove()
    assert "temp" not in A.backend_names()
    handle.remove()  # idempotent
    with pytest.raises(A.UnsupportedConfigError, match="unknown attention backend 'temp'"):
        A.create_backend("temp")


def test_remove_does_not_unregister_a_replacement() -> None:
    first = A.register_backend("dup", make_backend("dup"))
    second = A.register_backend("dup", make_backend("dup2"), replace=True)
    first.remove()
    assert "dup" in A.backend_names()
    assert A.create_backend("dup").name == "dup2"
    second.remove()
    assert "dup" not in A.backend_names()


def test_duplicate_name_needs_replace() -> None:
    A.register_backend("dup", make_backend("one"))
    with pytest.raises(A.UnsupportedConfigError, match=r"already registered.*replace=True"):
        A.register_backend("dup", make_backend("two"))
    assert A.create_backend("dup").name == "one"
    A.register_backend("dup", make_backend("two"), replace=True)
    assert A.create_backend("dup").name == "two"


def test_builtin_needs_replace_too() -> None:
    with pytest.raises(A.UnsupportedConfigError, match="'reference' is already registered"):
        A.register_backend("reference", make_backend("reference"))


@pytest.mark.parametrize("name", ["auto", "Auto", "AUTO", "", None, 3])
def test_reserved_and_empty_names_are_rejected(name: Any) -> None:
    with pytest.raises(A.UnsupportedConfigError, match="cannot register a backend named"):
        A.register_backend(name, ReferenceBackend)


def test_backend_names_by_priority_then_name() -> None:
    A.register_backend("zz-high", make_backend("zz-high"), priority=10_000)
    A.register_backend("aa-high", make_backend("aa-high"), priority=10_000)
    A.register_backend("low", make_backend("low"), priority=-10_000)
    names = A.backend_names()
    assert names[:2] == ["aa-high", "zz-high"]
    assert names[-1] == "low"
    assert names.index("reference") < names.index("low")


def test_options_model_comes_from_the_factory_when_not_given() -> None:
    A.register_backend("opts", make_backend("opts"))
    config = A.AttentionConfig(backend="opts", tile=128)
    assert config.options == Options(tile=128)
    backend: Any = A.create_backend(config)
    assert backend.options == Options(tile=128)


def test_explicit_options_model() -> None:
    class Other(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")
        depth: int = 1

    A.register_backend("explicit-opts", make_backend("explicit-opts"), options=Other)
    assert A.AttentionConfig(backend="explicit-opts", depth=3).options == Other(depth=3)
    backend: Any = A.create_backend("explicit-opts")
    assert backend.options == Other()


# --- unknown names -----------------------------------------------------------------------------


def test_unknown_name_lists_known_names_and_closest_match() -> None:
    A.register_backend("flashy", make_backend("flashy"))
    with pytest.raises(A.UnsupportedConfigError) as info:
        A.create_backend("refrence")
    message = str(info.value)
    assert "unknown attention backend 'refrence'" in message
    known = ", ".join(["auto", *sorted(A.backend_names())])
    assert "flashy" in known
    assert f"known backends: {known}." in message
    assert "Did you mean 'reference'?" in message


def test_unknown_name_without_close_match() -> None:
    with pytest.raises(
        A.UnsupportedConfigError, match=r"known backends: auto, .*reference"
    ) as info:
        A.explain("qqqqqq")
    assert "Did you mean" not in str(info.value)


# --- names ignore case ------------------------------------------------------------------------


def test_names_are_matched_ignoring_case() -> None:
    assert A.create_backend("REFERENCE").name == "reference"
    assert A.create_backend(A.AttentionConfig(backend="Reference")).name == "reference"
    assert list(A.explain("Reference")) == ["reference"]
    assert set(A.explain("AUTO", device="cpu")) == set(A.backend_names()) - {"routed"}
    assert _registry.lookup("FA3").name == "fa3"
    assert _registry.canonical_name("Auto") == "auto"


def test_registered_names_stay_as_registered() -> None:
    A.register_backend("MyKernel", make_backend("MyKernel"), priority=-1)
    assert "MyKernel" in A.backend_names()
    assert A.AttentionConfig(backend="mykernel").backend == "MyKernel"
    assert A.create_backend("MYKERNEL").name == "MyKernel"
    assert list(A.explain("mykernel")) == ["MyKernel"]


def test_names_differing_only_in_case_match_exactly_or_not_at_all() -> None:
    A.register_backend("Flash", make_backend("Flash"), priority=-1)
    A.register_backend("FLASH", make_backend("FLASH"), priority=-1)
    assert A.create_backend("Flash").name == "Flash"  # an exact name wins
    assert A.create_backend("FLASH").name == "FLASH"
    with pytest.raises(A.UnsupportedConfigError, match="'flash' is ambiguous") as info:
        A.create_backend("flash")
    message = str(info.value)
    assert "'FLASH' and 'Flash'" in message
    assert "use the exact name" in message
    assert [r.field for r in info.value.reasons] == ["backend"]
    with pytest.raises(A.UnsupportedConfigError, match="ambiguous"):
        A.AttentionConfig(backend="fLaSh")


def test_suggestions_ignore_case() -> None:
    with pytest.raises(A.UnsupportedConfigError, match=r"Did you mean 'reference'\?"):
        A.create_backend("REFRENCE")


def test_auto_candidates_ignore_case_and_explain_follows_them() -> None:
    A.register_backend("top", make_backend("top"), priority=10_000)
    config = A.AttentionConfig(backend="auto", candidates=["REFERENCE", "Top"])
    assert A.create_backend(config).name == "reference"
    assert list(A.explain(config, device="cpu")) == ["reference", "top"]  # tried in this order


# --- auto selection ----------------------------------------------------------------------------


def test_auto_picks_highest_priority_that_can_run_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    no_gpu = A.Reason(ENV, "device", "needs a CUDA GPU, but none is visible")
    A.register_backend("fast", make_backend("fast", env=[no_gpu]), priority=10_000)
    A.register_backend("good", make_backend("good"), priority=5_000)
    A.register_backend("slow", make_backend("slow"), priority=1_000)
    with caplog.at_level(logging.INFO, logger="attnsdk"):
        assert A.create_backend("auto").name == "good"
        assert A.create_backend(A.AttentionConfig()).name == "good"
        assert A.create_backend().name == "good"
    records = [r for r in caplog.records if r.name == "attnsdk"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert message.startswith("attnsdk auto backend: good")
    assert "fast: environment: device needs a CUDA GPU" in message


def test_auto_candidates_restrict_and_order() -> None:
    A.register_backend("good", make_backend("good"), priority=50)
    config = A.AttentionConfig(backend="auto", candidates=["reference", "good"])
    assert A.create_backend(config).name == "reference"


def test_auto_with_nothing_runnable_raises_every_reason() -> None:
    why = [A.Reason(ENV, "install", "pip install thing"), A.Reason(ENV, "device", "no GPU")]
    A.register_backend("never", make_backend("never", env=why))
    config = A.AttentionConfig(backend="auto", candidates=["never"])
    with pytest.raises(A.UnsupportedConfigError, match="no attention backend can run here") as info:
        A.create_backend(config)
    assert list(info.value.reasons) == [
        A.Reason(r.kind, f"never.{r.field}", r.message) for r in why
    ]


# --- explicit selection ------------------------------------------------------------------------


def test_explicit_backend_that_cannot_run_raises_every_reason_environment_first() -> None:
    why = [
        A.Reason(ENV, "install", "flash_attn_interface is missing: pip install 'attnsdk[fa3]'"),
        A.Reason(ENV, "compute_capability", "must be >= 9.0, found 8.0"),
    ]
    created: list[object] = []
    A.register_backend("gpu-only", make_backend("gpu-only", env=why, created=created))
    with pytest.raises(A.UnsupportedConfigError) as info:
        A.create_backend("gpu-only")
    assert list(info.value.reasons) == why
    assert all(r.kind is ENV for r in info.value.reasons)
    message = str(info.value)
    assert message.startswith("backend 'gpu-only' cannot run here:")
    assert all(str(r) in message for r in why)
    assert created == []  # it never falls back and never half-creates


def test_explicit_backend_never_falls_back() -> None:
    no = [A.Reason(ENV, "device", "no GPU")]
    A.register_backend("top", make_backend("top", env=no), priority=10_000)
    with pytest.raises(A.UnsupportedConfigError):
        A.create_backend(A.AttentionConfig(backend="top"))


def test_create_backend_none_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    A.register_backend("from-env", make_backend("from-env"), priority=-100)
    monkeypatch.setenv("ATTNSDK_BACKEND", "from-env")
    monkeypatch.delenv("ATTNSDK_CONFIG", raising=False)
    assert A.create_backend(None).name == "from-env"
    monkeypatch.delenv("ATTNSDK_BACKEND")
    assert A.create_backend(None).name == A.create_backend("auto").name


def test_create_backend_none_with_an_unknown_env_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSDK_BACKEND", "refrence")
    monkeypatch.delenv("ATTNSDK_CONFIG", raising=False)
    with pytest.raises(A.UnsupportedConfigError, match="Did you mean 'reference'"):
        A.create_backend(None)


def test_a_broken_plugin_is_a_backend_that_cannot_run() -> None:
    A.register_backend("broken", "attnsdk_no_such_module_xyz:Backend", priority=10_000)
    assert A.create_backend("auto").name != "broken"
    (reason,) = A.explain("auto", device="cpu")["broken"]
    assert reason.kind is ENV
    assert reason.field == "import"
    assert "ModuleNotFoundError" in reason.message
    with pytest.raises(A.UnsupportedConfigError, match="backend 'broken' cannot run here") as info:
        A.create_backend("broken")
    assert list(info.value.reasons) == [reason]


# --- explain -----------------------------------------------------------------------------------


def test_explain_one_backend_returns_reasons_as_data() -> None:
    A.register_backend("small", make_backend("small", max_head_dim=128))
    layer = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=256)
    result = A.explain("small", layer, device="cpu")
    assert list(result) == ["small"]
    # V's head dim defaults to head_dim, so both exceed the limit.
    assert result["small"] == [
        A.Reason(CFG, "head_dim", "must be <= 128 and a multiple of 1, found 256"),
        A.Reason(CFG, "v_head_dim", "must be <= 128 and a multiple of 1, found 256"),
    ]
    assert A.explain("small", A.LayerSpec(8, 2, 64), device="cpu") == {"small": []}


def test_explain_lists_environment_before_configuration() -> None:
    no_gpu = A.Reason(ENV, "device", "needs a CUDA GPU")
    A.register_backend("both", make_backend("both", env=[no_gpu], max_head_dim=64))
    layer = A.LayerSpec(num_heads=4, num_kv_heads=4, head_dim=128)
    layout = A.KVCacheLayout(num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.float16)
    reasons = A.explain(A.AttentionConfig(backend="both"), layer, layout, device="cpu")["both"]
    assert reasons[0] == no_gpu
    kinds = [r.kind for r in reasons]
    assert kinds == sorted(kinds)
    fields = {r.field for r in reasons[1:]}
    assert {"head_dim", "v_head_dim", "dtype"} <= fields


def test_explain_auto_lists_every_backend_by_priority() -> None:
    A.register_backend("small", make_backend("small", max_head_dim=64), priority=10_000)
    layer = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
    result = A.explain("auto", layer, device="cpu")
    names = list(result)
    assert names.index("small") < names.index("reference")
    assert [r.field for r in result["small"]] == ["head_dim", "v_head_dim"]
    assert result["reference"] == []


def test_explain_reference_on_a_missing_device_is_an_environment_reason() -> None:
    reasons = A.explain("reference", device="meta")["reference"]
    assert reasons
    assert reasons[0].kind is ENV
    assert reasons[0].field == "device"


# --- entry points ------------------------------------------------------------------------------


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A fake installed distribution exposing two backends in the ``attnsdk.backends`` group."""
    created: list[object] = []
    module = types.ModuleType("attnsdk_fake_plugin")
    plug = make_backend("plug", created=created)
    plug.priority = 10_000  # type: ignore[attr-defined]
    module.PlugBackend = plug  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "attnsdk_fake_plugin", module)
    calls: list[str | None] = []

    def fake_entry_points(*, group: str | None = None) -> list[EntryPoint]:
        calls.append(group)
        if group != _registry.ENTRY_POINT_GROUP:
            return []
        return [
            EntryPoint("plug", "attnsdk_fake_plugin:PlugBackend", group),
            EntryPoint("reference", "attnsdk_fake_plugin:PlugBackend", group),
        ]

    monkeypatch.setattr(_registry, "entry_points", fake_entry_points)
    monkeypatch.setattr(_registry, "_PLUGINS_LOADED", False)
    return {"calls": calls, "created": created}


def test_entry_points_are_discovered_lazily_and_once(plugin: dict[str, Any]) -> None:
    assert plugin["calls"] == []
    names = A.backend_names()
    assert plugin["calls"] == [_registry.ENTRY_POINT_GROUP]
    assert names[0] == "plug"  # the plugin's own priority attribute
    A.backend_names()
    A.explain("plug", device="cpu")
    assert plugin["calls"] == [_registry.ENTRY_POINT_GROUP]
    assert plugin["created"] == []  # listed and explained from class data, never created


def test_entry_point_backend_is_created_with_its_options(plugin: dict[str, Any]) -> None:
    backend: Any = A.create_backend(A.AttentionConfig(backend="plug", tile=32))
    assert backend.name == "plug"
    assert plugin["created"] == [Options(tile=32)]


def test_entry_point_cannot_shadow_a_builtin(plugin: dict[str, Any]) -> None:
    assert A.create_backend("reference").name == "reference"
    assert isinstance(A.create_backend("reference"), ReferenceBackend)
    assert plugin["created"] == []


def test_entry_points_are_loaded_before_a_registration_claims_the_name(
    plugin: dict[str, Any],
) -> None:
    with pytest.raises(A.UnsupportedConfigError, match="'plug' is already registered"):
        A.register_backend("plug", ReferenceBackend)


def test_a_plugin_registering_at_import_never_deadlocks_a_lookup(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thread A imports a plugin whose import calls register_backend; thread B lists backends
    meanwhile (which needs that plugin's class for its priority). Neither may wait forever:
    the registry never imports while holding its lock."""
    import threading

    (tmp_path / "attnsdk_slow_plugin.py").write_text(
        "import threading\n"
        "import attnsdk\n"
        "from attnsdk.backends.reference import ReferenceBackend\n"
        "started, go = threading.Event(), threading.Event()\n"
        "import builtins\n"
        "builtins._attnsdk_slow_plugin_events = (started, go)\n"
        "started.set()\n"
        "go.wait(10)\n"
        "class SlowBackend(ReferenceBackend):\n"
        "    priority = -5\n"
        "attnsdk.register_backend('slow-extra', ReferenceBackend, priority=-6)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        _registry,
        "entry_points",
        lambda *, group=None: (
            [EntryPoint("slow", "attnsdk_slow_plugin:SlowBackend", _registry.ENTRY_POINT_GROUP)]
            if group == _registry.ENTRY_POINT_GROUP
            else []
        ),
    )
    monkeypatch.setattr(_registry, "_PLUGINS_LOADED", False)
    import builtins

    names: list[list[str]] = []
    importer = threading.Thread(target=lambda: __import__("attnsdk_slow_plugin"), daemon=True)
    importer.start()
    for _ in range(200):
        if hasattr(builtins, "_attnsdk_slow_plugin_events"):
            break
        threading.Event().wait(0.01)
    started, go = builtins._attnsdk_slow_plugin_events  # type: ignore[attr-defined]
    assert started.wait(10)
    lister = threading.Thread(target=lambda: names.append(A.backend_names()), daemon=True)
    lister.start()
    threading.Event().wait(0.2)  # the lister is now waiting for the plugin's import
    go.set()
    importer.join(10)
    lister.join(10)
    del builtins._attnsdk_slow_plugin_events  # type: ignore[attr-defined]
    assert not importer.is_alive(), "the plugin's import is stuck"
    assert not lister.is_alive(), "the lookup is stuck"
    assert "slow" in names[0]
    assert "slow-extra" in A.backend_names()
    sys.modules.pop("attnsdk_slow_plugin", None)


def test_register_reads_the_class_priority_and_can_keep_a_backend_out_of_auto() -> None:
    from attnsdk.backends.reference import ReferenceBackend

    class Eager(ReferenceBackend):
        name = "eager-ref"
        priority = 1000

    A.register_backend("eager-ref", Eager)  # priority None: the class's 1000
    assert A.backend_names()[0] == "eager-ref"
    assert A.create_backend("auto", device="cpu").name == "eager-ref"
    A.register_backend("eager-ref", Eager, auto=False, replace=True)
    assert "eager-ref" in A.backend_names()
    assert "eager-ref" not in A.explain("auto", device="cpu")
    assert A.create_backend("auto", device="cpu").name == "reference"
    assert A.create_backend("eager-ref").name == "eager-ref"
