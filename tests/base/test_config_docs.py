"""docs/config.md is generated from the config models (ray_cluster_ft/_config_docs.py): it must match them, and
every field must carry a description to generate it from."""

from pathlib import Path

from pydantic import BaseModel

from ray_cluster_ft import _config_docs
from ray_cluster_ft.config import PRESETS, JobConfig

ROOT = Path(__file__).resolve().parents[2]


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, f in model.model_fields.items():
        yield prefix + name, f
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            yield from _fields(f.annotation, f"{prefix}{name}.")


def test_docs_config_md_is_up_to_date():
    path = ROOT / "docs" / "config.md"
    assert path.is_file(), f"docs/config.md is missing: generate it with `{_config_docs.COMMAND}`"
    assert path.read_text(encoding="utf-8") == _config_docs.render(), (
        f"docs/config.md is stale (the config models changed): regenerate it with `{_config_docs.COMMAND}` "
        "(or `python scripts/gen_config_docs.py`) and commit it")


def test_every_field_has_a_description_and_every_section_a_docstring():
    missing = [key for key, f in _fields(JobConfig) if not (f.description or "").strip()]
    assert not missing, f"config fields without a description (docs/config.md is generated from them): {missing}"
    undocumented = [f.annotation.__name__ for _, f in _fields(JobConfig)
                    if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
                    and not (f.annotation.__doc__ or "").strip()]
    assert not undocumented, undocumented


def test_render_names_every_key_and_preset_and_is_deterministic():
    text = _config_docs.render()
    assert text == _config_docs.render()
    for key, _ in _fields(JobConfig):
        assert f"`{key}`" in text, key
    for name, keys in PRESETS.items():
        assert f"### `{name}`" in text
        for section, values in keys.items():
            for k in values:
                assert f"| `{section}.{k}` |" in text, (name, section, k)


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("old\n", encoding="utf-8")
    assert _config_docs.main(["--check", "--output", str(stale)]) == 1
    assert _config_docs.COMMAND in capsys.readouterr().out
    assert _config_docs.main(["--output", str(stale)]) == 0
    assert _config_docs.main(["--check", "--output", str(stale)]) == 0
    assert stale.read_text(encoding="utf-8") == _config_docs.render()
