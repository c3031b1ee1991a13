"""distill.data against naive references: what counts as a prepared folder."""

from __future__ import annotations

import json

import pytest

from core.tiny import tiny_tokenizer
from distill.data import DataError, build_data


def test_a_dataset_folder_with_its_own_meta_json_is_read_as_data_not_called_a_damaged_cache(tmp_path):
    ds = tmp_path / "corpus"
    ds.mkdir()
    (ds / "train.jsonl").write_text("".join(json.dumps({"text": f"the quick brown fox {i}"}) + "\n" for i in range(50)))
    (ds / "meta.json").write_text(json.dumps({"name": "my corpus", "license": "cc-by"}))  # a corpus card
    with pytest.raises(DataError) as err:
        build_data(tiny_tokenizer(), dataset=str(ds), seq_len=16, eval_blocks=1, data_cache=str(tmp_path / "cache"),
                   progress=False)
    # The folder's files are read (and the card is named as what does not parse), never "delete <the data>".
    assert "cannot read" in str(err.value) and "delete" not in str(err.value)
