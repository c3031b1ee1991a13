"""distill.data: packing boundaries of a stream and how held-out blocks are shared between sources."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.tiny import tiny_tokenizer
from distill.data.corpus import _split_eval
from distill.data.prepare import PackSettings
from distill.data.stream import StreamBlocks, _Packer
from distill.data.text import SourceSpec


def _pack_all(lengths: list[int], seq_len: int, with_mask: bool):
    """Feed documents of ``lengths`` (ids counting up, masks alternating by document) and collect every block."""
    packer, start, out = _Packer(seq_len, with_mask), 0, []
    for d, n in enumerate(lengths):
        ids = list(range(start, start + n))
        start += n
        out += list(packer.add(ids, [d % 2] * n if with_mask else None))
    return out, start


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("lengths", [[8], [3, 5], [4, 4, 8], [3, 9, 2, 7, 3], [1] * 16, [20, 4], [5, 2, 1]])
def test_packed_blocks_are_the_joined_documents_cut_every_seq_len(lengths, with_mask):
    """Every whole block of the joined stream comes out, in order, the moment it is complete; a block that
    ends exactly with a document is not held back (at the end of a stream it would be lost)."""
    seq = 8
    blocks, total = _pack_all(lengths, seq, with_mask)
    assert len(blocks) == total // seq
    joined_mask = np.concatenate([[d % 2] * n for d, n in enumerate(lengths)])
    for k, (ids, mask) in enumerate(blocks):
        assert ids.tolist() == list(range(k * seq, (k + 1) * seq))
        if with_mask:
            assert mask.tolist() == joined_mask[k * seq:(k + 1) * seq].astype(bool).tolist()
        else:
            assert mask is None
    # and each block is out as soon as its last token is in
    packer, fed, seen = _Packer(seq, False), 0, 0
    for n in lengths:
        seen += len(list(packer.add([0] * n, None)))
        fed += n
        assert seen == fed // seq


def test_a_stream_whose_tokens_fill_its_last_block_exactly_yields_that_block(tmp_path):
    tok = tiny_tokenizer()
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over the lazy dog and a teacher distills a student".split()
    src = tmp_path / "a.jsonl"
    src.write_text("\n".join(json.dumps({"text": " ".join(rng.choice(words, size=12))}) for _ in range(40)) + "\n")
    spec = SourceSpec(str(src), streaming=True)
    tokens = [int(b[0][0]) for b in StreamBlocks(spec, tok, PackSettings(1, 0.2, True, "split")).blocks("train")]
    assert len(tokens) > 100
    n = len(tokens)
    for seq_len in [n, *(n // d for d in (2, 3, 5, 7) if n % d == 0)]:  # the last block ends with the stream
        blocks = [b for b, _ in StreamBlocks(spec, tok, PackSettings(seq_len, 0.2, True, "split")).blocks("train")]
        assert len(blocks) == len(tokens) // seq_len
        assert np.concatenate(blocks).tolist() == tokens


def test_heldout_blocks_are_shared_by_weight_with_the_largest_remainders_rounded_up():
    assert _split_eval(10, [0.26, 0.74], [99, 99]) == [3, 7]  # 2.6 / 7.4: the 0.6 remainder gets the block
    assert _split_eval(7, [5, 3, 2], [99, 99, 99]) == [4, 2, 1]  # 3.5 / 2.1 / 1.4
    assert _split_eval(11, [1, 1, 2], [99, 99, 99]) == [3, 3, 5]  # 2.75 / 2.75 / 5.5: both 0.75s round up
    for total in range(0, 30):
        got = _split_eval(total, [3, 1, 1], [99, 99, 99])
        assert sum(got) == total and all(abs(g - total * w / 5) < 1 for g, w in zip(got, [3, 1, 1]))


def test_a_small_source_gives_what_it_has_and_the_others_fill_the_rest_within_their_own_blocks():
    assert _split_eval(10, [0.5, 0.5], [2, 99]) == [2, 8]
    assert _split_eval(10, [1, 1, 1], [1, 2, 99]) == [1, 2, 7]
    # nobody gives more than it has, even when the set cannot be filled
    assert _split_eval(10, [1, 1], [3, 4]) == [3, 4]
    for avail in ([0, 5, 5], [1, 1, 1], [4, 0, 9], [2, 3, 1]):
        got = _split_eval(8, [2, 1, 1], avail)
        assert all(0 <= g <= a for g, a in zip(got, avail))
        assert sum(got) == min(8, sum(avail))


def test_a_separate_eval_dataset_is_not_booked_as_a_training_sources_heldout_blocks(tmp_path):
    from distill.data import build_data

    def jsonl(path, n, tag):
        path.write_text("\n".join(json.dumps({"text": f"{tag} number {i} says hello to the world " * 4}) for i in range(n)))
        return str(path)

    a, b = jsonl(tmp_path / "a.jsonl", 80, "alpha"), jsonl(tmp_path / "b.jsonl", 80, "beta")
    held = jsonl(tmp_path / "h.jsonl", 40, "gamma")
    data = build_data(tiny_tokenizer(), datasets=[a, b], eval_dataset=held, seq_len=16, eval_blocks=6,
                      data_cache=str(tmp_path / "c"), progress=False)
    assert data.eval.shape[0] == 6
    assert [r.eval_blocks for r in data.sources] == [0, 0]  # none of theirs is held out
