"""recipes/export.py's overwrite=true replaces only an export it wrote (its export.json), never a model folder
someone else made, nor the teacher its quantization gate reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import ConfigError
from core.tiny import save_tiny
from recipes.export import MARKER, ExportConfig, export


def test_an_export_records_what_it_was_made_from(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "final")
    export(ExportConfig(source=str(src), output_dir=str(tmp_path / "export"), dtype="bf16"))
    made = json.loads((tmp_path / "export" / MARKER).read_text())
    assert made["source"] == str(Path(src).resolve()) and made["dtype"] == "bfloat16"
    assert made["quantize"] == "none" and made["environment"]["packages"]["torch"]


def test_overwrite_never_replaces_a_model_folder_the_recipe_did_not_write(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "final", seed=0)
    someone_elses = Path(save_tiny(tmp_path / "teacher", seed=2))
    (someone_elses / "my_notes.txt").write_text("precious")
    before = {p.name: p.read_bytes() for p in someone_elses.iterdir()}
    with pytest.raises(ConfigError, match=f"is not an export written by recipes/export.py \\(no {MARKER}\\)"):
        export(ExportConfig(source=str(src), output_dir=str(someone_elses), overwrite=True))
    assert {p.name: p.read_bytes() for p in someone_elses.iterdir()} == before
    # an export it wrote is replaced
    out = tmp_path / "export"
    export(ExportConfig(source=str(src), output_dir=str(out)))
    export(ExportConfig(source=str(src), output_dir=str(out), dtype="bf16", overwrite=True))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_quantization_gate_teacher_is_never_the_folder_replaced(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "final", seed=0)
    out = tmp_path / "export"
    export(ExportConfig(source=str(src), output_dir=str(out)))  # an export of ours, so overwrite may replace it
    with pytest.raises(ConfigError, match="contains the source"):
        export(ExportConfig(source=str(src), output_dir=str(out), overwrite=True, quantize="int8",
                            quant_gate_teacher=str(out)))
    assert (out / MARKER).is_file() and (out / "model.safetensors").is_file()
