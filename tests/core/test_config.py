"""AttentionConfig: frozen, strict, options per backend, from files and from the environment."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import pydantic
import pytest

import attnsdk as A
from attnsdk.backends.reference import ReferenceOptions
from attnsdk.selection.config import config_in_effect

if TYPE_CHECKING:
    from pathlib import Path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No ATTNSDK_* variables, and a current directory without a pyproject.toml (the checkout's
    own could hold a [tool.attnsdk] table)."""
    monkeypatch.delenv("ATTNSDK_BACKEND", raising=False)
    monkeypatch.delenv("ATTNSDK_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


# --- the model ---------------------------------------------------------------------------------


def test_default_is_auto() -> None:
    config = A.AttentionConfig()
    assert config.backend == "auto"
    assert config.options == A.AutoOptions()
    assert config.options.candidates is None  # type: ignore[attr-defined]


def test_frozen() -> None:
    config = A.AttentionConfig(backend="reference")
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.backend = "auto"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.options.max_scores = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "data",
    [
        {"backend": "reference", "max_score": 4096},  # a typo of max_scores
        {"backend": "reference", "options": {"tile": 1}},
        {"backend": "auto", "max_scores": 4096},  # another backend's option
    ],
)
def test_extra_fields_are_forbidden(data: dict[str, Any]) -> None:
    with pytest.raises(A.InvalidInputError, match=r"^options\.\w+: expected an option of backend"):
        A.AttentionConfig.model_validate(data)


def test_flat_and_nested_options_are_the_same() -> None:
    flat = A.AttentionConfig(backend="reference", max_scores=1024)
    nested = A.AttentionConfig.model_validate(
        {"backend": "reference", "options": {"max_scores": 1024}}
    )
    typed = A.AttentionConfig(backend="reference", options=ReferenceOptions(max_scores=1024))
    assert flat == nested == typed
    assert flat.options == ReferenceOptions(max_scores=1024)


def test_flat_and_nested_together_is_an_error() -> None:
    with pytest.raises(A.InvalidInputError, match="either flat or under 'options'"):
        A.AttentionConfig.model_validate(
            {"backend": "reference", "options": {"max_scores": 1}, "max_scores": 2}
        )


def test_options_model_is_the_backends_own() -> None:
    assert isinstance(A.AttentionConfig(backend="reference").options, ReferenceOptions)
    assert isinstance(A.AttentionConfig(backend="auto").options, A.AutoOptions)
    with pytest.raises(A.InvalidInputError, match="expected a ReferenceOptions"):
        A.AttentionConfig(backend="reference", options=A.AutoOptions())


def test_options_are_validated_by_their_model() -> None:
    with pytest.raises(A.InvalidInputError, match=r"^options\.max_scores: expected a valid value"):
        A.AttentionConfig(backend="reference", max_scores=0)


def test_auto_candidates() -> None:
    config = A.AttentionConfig(backend="auto", candidates=["reference"])
    assert config.options == A.AutoOptions(candidates=("reference",))


@pytest.mark.parametrize("empty", [[], ()])
def test_auto_candidates_empty_is_refused(empty: Any) -> None:
    """An empty list used to mean "every backend" silently; omitting the field says that."""
    with pytest.raises(pydantic.ValidationError, match=r"omit candidates"):
        A.AutoOptions(candidates=empty)
    with pytest.raises(A.InvalidInputError, match=r"^options\.candidates: .*omit candidates"):
        A.AttentionConfig(candidates=empty)
    assert A.AutoOptions(candidates=None) == A.AutoOptions()


def test_backend_must_be_a_known_string() -> None:
    with pytest.raises(A.InvalidInputError, match=r"^backend: expected a backend name \(str\)"):
        A.AttentionConfig.model_validate({"backend": 3})
    with pytest.raises(A.UnsupportedConfigError, match="unknown attention backend 'nope'"):
        A.AttentionConfig(backend="nope")


def test_round_trips_through_a_dict() -> None:
    config = A.AttentionConfig(backend="reference", max_scores=77)
    dumped = config.model_dump()
    assert dumped == {"backend": "reference", "options": {"max_scores": 77}, "debug": False}
    assert A.AttentionConfig.model_validate(dumped) == config
    assert A.AttentionConfig.model_validate_json(config.model_dump_json()) == config


def test_create_backend_uses_the_options() -> None:
    backend: Any = A.create_backend(A.AttentionConfig(backend="reference", max_scores=99))
    assert backend.options == ReferenceOptions(max_scores=99)


# --- from_file ---------------------------------------------------------------------------------

FILES = {
    "c.json": json.dumps({"backend": "reference", "max_scores": 512}),
    "nested.json": json.dumps({"backend": "reference", "options": {"max_scores": 512}}),
    "c.toml": 'backend = "reference"\nmax_scores = 512\n',
    "table.toml": '[tool]\nx = 1\n\n[attnsdk]\nbackend = "reference"\nmax_scores = 512\n',
    "nested.toml": '[attnsdk]\nbackend = "reference"\n\n[attnsdk.options]\nmax_scores = 512\n',
    "c.yaml": "backend: reference\nmax_scores: 512\n",
    "c.yml": "backend: reference\noptions:\n  max_scores: 512\n",
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_from_file(tmp_path: Path, name: str) -> None:
    if name.endswith((".yaml", ".yml")):
        pytest.importorskip("yaml", reason="PyYAML is not installed")
    path = tmp_path / name
    path.write_text(FILES[name])
    expected = A.AttentionConfig(backend="reference", max_scores=512)
    assert A.AttentionConfig.from_file(path) == expected
    assert A.AttentionConfig.from_file(str(path)) == expected


def test_yaml_without_pyyaml_names_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes ``import yaml`` fail
    path = tmp_path / "c.yaml"
    path.write_text(FILES["c.yaml"])
    with pytest.raises(A.UnsupportedConfigError, match="needs PyYAML: pip install pyyaml"):
        A.AttentionConfig.from_file(path)


def test_empty_file_is_auto(tmp_path: Path) -> None:
    path = tmp_path / "empty.toml"
    path.write_text("")
    assert A.AttentionConfig.from_file(path) == A.AttentionConfig()


def test_bad_suffix(tmp_path: Path) -> None:
    path = tmp_path / "config.ini"
    path.write_text("[attnsdk]\nbackend = reference\n")
    with pytest.raises(A.UnsupportedConfigError, match=r"expected a \.json, \.toml, \.yaml"):
        A.AttentionConfig.from_file(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(A.UnsupportedConfigError, match="does not exist"):
        A.AttentionConfig.from_file(tmp_path / "nope.json")
    with pytest.raises(A.UnsupportedConfigError, match="does not exist"):
        A.AttentionConfig.from_file(tmp_path)  # a directory is not a config file


@pytest.mark.parametrize(
    ("name", "text"),
    [("bad.json", "{backend: reference"), ("bad.toml", "backend = = 1"), ("bad.yaml", "a: [1")],
)
def test_malformed_file_names_the_file(tmp_path: Path, name: str, text: str) -> None:
    if name.endswith(".yaml"):
        pytest.importorskip("yaml", reason="PyYAML is not installed")
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(A.UnsupportedConfigError, match="cannot be parsed") as info:
        A.AttentionConfig.from_file(path)
    assert name in str(info.value)


def test_file_holding_a_list(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text('["reference"]')
    with pytest.raises(A.UnsupportedConfigError, match="expected a mapping, found list"):
        A.AttentionConfig.from_file(path)


def test_file_with_an_unknown_backend(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"backend": "refernce"}')
    with pytest.raises(A.UnsupportedConfigError, match="Did you mean 'reference'"):
        A.AttentionConfig.from_file(path)


def test_file_with_an_unknown_option(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"backend": "reference", "max_scorez": 1}')
    with pytest.raises(
        A.InvalidInputError,
        match=r"^options\.max_scorez: .*Did you mean 'max_scores'\? In attention config file '.*c\.json'",
    ):
        A.AttentionConfig.from_file(path)


# --- from_env ----------------------------------------------------------------------------------


def test_from_env_default_is_auto() -> None:
    assert A.AttentionConfig.from_env() == A.AttentionConfig()


def test_from_env_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSDK_BACKEND", "reference")
    assert A.AttentionConfig.from_env() == A.AttentionConfig(backend="reference")
    monkeypatch.setenv("ATTNSDK_BACKEND", "")
    assert A.AttentionConfig.from_env() == A.AttentionConfig()


def test_from_env_unknown_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSDK_BACKEND", "refrence")
    with pytest.raises(A.UnsupportedConfigError, match="Did you mean 'reference'"):
        A.AttentionConfig.from_env()


def test_from_env_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "attn.toml"
    path.write_text(FILES["c.toml"])
    monkeypatch.setenv("ATTNSDK_CONFIG", str(path))
    expected = A.AttentionConfig(backend="reference", max_scores=512)
    assert A.AttentionConfig.from_env() == expected
    monkeypatch.setenv("ATTNSDK_BACKEND", "reference")  # agreeing with the file is fine
    assert A.AttentionConfig.from_env() == expected


def test_from_env_contradiction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "attn.json"
    path.write_text(json.dumps({"backend": "reference"}))
    monkeypatch.setenv("ATTNSDK_CONFIG", str(path))
    monkeypatch.setenv("ATTNSDK_BACKEND", "auto")
    with pytest.raises(A.UnsupportedConfigError, match="contradicts") as info:
        A.AttentionConfig.from_env()
    assert "ATTNSDK_BACKEND='auto'" in str(info.value)
    assert str(path) in str(info.value)


def test_from_env_missing_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSDK_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(A.UnsupportedConfigError, match="does not exist"):
        A.AttentionConfig.from_env()


def test_create_backend_none_reads_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "attn.json"
    path.write_text(json.dumps({"backend": "reference", "max_scores": 3}))
    monkeypatch.setenv("ATTNSDK_CONFIG", str(path))
    backend: Any = A.create_backend(None)
    assert backend.name == "reference"
    assert backend.options == ReferenceOptions(max_scores=3)
    monkeypatch.delenv("ATTNSDK_CONFIG")
    monkeypatch.setenv("ATTNSDK_BACKEND", "reference")
    assert A.create_backend().name == "reference"


# --- names, option suggestions, the attnsdk wrapper --------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"), [("FA3", "fa3"), ("Reference", "reference"), ("AUTO", "auto")]
)
def test_backend_names_ignore_case(name: str, expected: str) -> None:
    assert A.AttentionConfig(backend=name).backend == expected
    assert A.AttentionConfig(backend=name) == A.AttentionConfig(backend=expected)


def test_an_option_misspelling_suggests_the_option_flat_and_nested() -> None:
    for data in (
        {"backend": "reference", "max_scorez": 1},
        {"backend": "reference", "options": {"max_scorez": 1}},
        {"backend": "Reference", "options": {"max_scorez": 1}},
    ):
        with pytest.raises(A.InvalidInputError, match=r"Did you mean 'max_scores'\?") as info:
            A.AttentionConfig.model_validate(data)
        assert info.value.field == "options.max_scorez"
    with pytest.raises(A.InvalidInputError, match=r"Did you mean 'candidates'\?"):
        A.AttentionConfig.model_validate({"backend": "auto", "options": {"candidate": ["x"]}})


WRAPPED = {
    "wrapped.json": json.dumps({"attnsdk": {"backend": "REFERENCE", "max_scores": 512}}),
    "wrapped.yaml": "attnsdk:\n  backend: reference\n  options:\n    max_scores: 512\n",
    "other-keys.json": json.dumps(
        {"other_tool": 1, "attnsdk": {"backend": "reference", "max_scores": 512}}
    ),
}


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_from_file_attnsdk_wrapper_in_every_format(tmp_path: Path, name: str) -> None:
    if name.endswith(".yaml"):
        pytest.importorskip("yaml", reason="PyYAML is not installed")
    path = tmp_path / name
    path.write_text(WRAPPED[name])
    assert A.AttentionConfig.from_file(path) == A.AttentionConfig(
        backend="reference", max_scores=512
    )


def test_from_file_wrapper_errors_name_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"attnsdk": "reference"}))
    with pytest.raises(A.UnsupportedConfigError, match="key 'attnsdk': expected a mapping") as info:
        A.AttentionConfig.from_file(path)
    assert str(path) in str(info.value)
    path.write_text(json.dumps({"attnsdk": {"backend": "reference", "max_scorez": 1}}))
    with pytest.raises(A.InvalidInputError) as err:
        A.AttentionConfig.from_file(path)
    assert err.value.field == "options.max_scorez"
    assert f"In attention config file {str(path)!r} (under 'attnsdk')" in str(err.value)


# --- [tool.attnsdk] in pyproject.toml ----------------------------------------------------------

PYPROJECT = '[project]\nname = "engine"\n\n[tool.attnsdk]\nbackend = "Reference"\nmax_scores = 64\n'
FROM_PYPROJECT = A.AttentionConfig(backend="reference", max_scores=64)


def test_from_pyproject_reads_the_tool_table(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text(PYPROJECT)
    assert A.AttentionConfig.from_pyproject(path) == FROM_PYPROJECT
    assert A.AttentionConfig.from_pyproject(str(tmp_path)) == FROM_PYPROJECT  # a folder
    path.write_text(
        '[tool.attnsdk]\nbackend = "reference"\n\n[tool.attnsdk.options]\nmax_scores = 64\n'
    )
    assert A.AttentionConfig.from_pyproject(path) == FROM_PYPROJECT
    assert A.AttentionConfig.from_file(path) == FROM_PYPROJECT  # ATTNSDK_CONFIG=pyproject.toml


def test_from_pyproject_searches_upward_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    deep = tmp_path / "src" / "engine"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert A.AttentionConfig.from_pyproject() == FROM_PYPROJECT
    # the nearest pyproject.toml is the project's own: without the table, nothing is set
    (tmp_path / "src" / "pyproject.toml").write_text('[project]\nname = "inner"\n')
    assert A.AttentionConfig.from_pyproject() is None


def test_from_pyproject_without_a_file_or_a_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert A.AttentionConfig.from_pyproject() is None  # no pyproject.toml here or above
    path = tmp_path / "pyproject.toml"
    path.write_text('[tool.ruff]\nline-length = 100\n[tool.other]\nattnsdk = "mentioned"\n')
    assert A.AttentionConfig.from_pyproject() is None
    with pytest.raises(A.UnsupportedConfigError, match=r"has no \[tool\.attnsdk\] table"):
        A.AttentionConfig.from_file(path)
    with pytest.raises(A.UnsupportedConfigError, match="does not exist"):
        A.AttentionConfig.from_pyproject(tmp_path / "missing" / "pyproject.toml")


def test_from_pyproject_errors_name_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text('[tool.attnsdk]\nbackend = "reference"\nmax_scorez = 1\n')
    with pytest.raises(A.InvalidInputError) as info:
        A.AttentionConfig.from_pyproject(path)
    assert info.value.field == "options.max_scorez"
    assert f"Did you mean 'max_scores'? In [tool.attnsdk] of {str(path)!r}" in str(info.value)
    path.write_text('[tool.attnsdk]\nbackend = "refrence"\n')
    with pytest.raises(A.UnsupportedConfigError, match="Did you mean 'reference'") as err:
        A.AttentionConfig.from_pyproject(path)
    assert str(path) in str(err.value)
    path.write_text('[tool]\nattnsdk = "fa3"\n')
    with pytest.raises(A.UnsupportedConfigError, match=r"key 'tool\.attnsdk': expected a mapping"):
        A.AttentionConfig.from_pyproject(path)
    path.write_text("[tool.attnsdk\n")
    with pytest.raises(A.UnsupportedConfigError, match="cannot be parsed") as err:
        A.AttentionConfig.from_pyproject(path)
    assert str(path) in str(err.value)


# --- precedence: ATTNSDK_CONFIG > ATTNSDK_BACKEND > [tool.attnsdk] > auto ----------------------


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder holding a pyproject.toml with [tool.attnsdk], as the current directory."""
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_from_env_falls_back_to_pyproject(project: Path) -> None:
    config, source = config_in_effect()
    assert config == A.AttentionConfig.from_env() == FROM_PYPROJECT
    assert (source.kind, source.value) == ("pyproject", str(project / "pyproject.toml"))
    assert str(source) == f"[tool.attnsdk] in {project / 'pyproject.toml'}"
    assert A.create_backend().name == "reference"


def test_backend_variable_beats_pyproject(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSDK_BACKEND", "auto")
    config, source = config_in_effect()
    assert config == A.AttentionConfig()  # the whole config: pyproject's options do not apply
    assert str(source) == "ATTNSDK_BACKEND=auto"


def test_config_variable_beats_both(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "attn.json"
    path.write_text(json.dumps({"backend": "reference", "max_scores": 9}))
    monkeypatch.setenv("ATTNSDK_CONFIG", str(path))
    monkeypatch.setenv("ATTNSDK_BACKEND", "REFERENCE")  # the same backend, in another case
    config, source = config_in_effect()
    assert config == A.AttentionConfig(backend="reference", max_scores=9)
    assert (source.kind, source.value) == ("ATTNSDK_CONFIG", str(path))
    monkeypatch.setenv("ATTNSDK_BACKEND", "auto")  # a contradiction still raises
    with pytest.raises(A.UnsupportedConfigError, match="contradicts"):
        A.AttentionConfig.from_env()


def test_default_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config, source = config_in_effect()
    assert config == A.AttentionConfig()
    assert (source.kind, source.value) == ("default", None)


def test_a_bad_backend_variable_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSDK_BACKEND", "refrence")
    with pytest.raises(A.UnsupportedConfigError, match=r"^ATTNSDK_BACKEND='refrence': unknown"):
        A.AttentionConfig.from_env()


def test_a_bad_pyproject_is_an_error_not_a_silent_auto(project: Path) -> None:
    (project / "pyproject.toml").write_text('[tool.attnsdk]\nbackend = "fa4"\n')
    with pytest.raises(A.UnsupportedConfigError, match="unknown attention backend 'fa4'") as info:
        A.create_backend()
    assert str(project / "pyproject.toml") in str(info.value)


def test_an_empty_yaml_file_is_auto_like_an_empty_toml_file(tmp_path: Path) -> None:
    pytest.importorskip("yaml", reason="PyYAML is not installed")
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set yet\n")
    assert A.AttentionConfig.from_file(path) == A.AttentionConfig()


def test_a_deleted_current_directory_is_no_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert A.AttentionConfig.from_pyproject() is None
    assert A.AttentionConfig.from_env() == A.AttentionConfig()
