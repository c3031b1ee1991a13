import json

import pytest
import torch

from core.tiny import tiny_tokenizer
from distill.data import BUILTIN, BlockOrder, DataError, build_data, pack, stdlib_docs, texts_from


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_builtin_corpus_is_real_text_with_disjoint_heldout():
    train, held = stdlib_docs("train"), stdlib_docs("eval")
    assert len(train) > 500 and len(held) > 20
    assert not set(train) & set(held)
    assert sum(len(d) for d in train) > 500_000
    assert all(len(d) >= 300 for d in held)


def test_pack_joins_with_eos_and_drops_only_the_remainder(tok):
    blocks = pack(["hello world", "the fox"], tok, 4)
    flat = []
    for t in ["hello world", "the fox"]:
        flat += tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert blocks.shape == (len(flat) // 4, 4)
    assert blocks.flatten().tolist() == flat[: blocks.numel()]


def test_block_order_is_deterministic_sharded_and_covers_epochs():
    order = BlockOrder(num_blocks=10, global_batch=4, seed=3)
    a = [order.step_indices(s).tolist() for s in range(5)]
    b = [BlockOrder(10, 4, 3).step_indices(s).tolist() for s in range(5)]
    assert a == b
    assert len(set(a[0] + a[1])) == 8  # no repeats within an epoch
    assert a[2] != a[0]  # a new epoch reshuffles
    blocks = torch.arange(10).unsqueeze(1)
    ranks = [[i.tolist() for i, _ in order.micro_batches(blocks, 1, r, 2, 1)] for r in range(2)]
    assert sorted(sum(ranks[0] + ranks[1], [])) == sorted(a[1])
    with pytest.raises(DataError, match="cannot fill one global batch"):
        BlockOrder(3, 4, 0)


def test_local_jsonl_text_and_chat(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"the quick brown fox {i}"}) for i in range(50)))
    assert len(texts_from(str(p), tok)) == 50
    t = tmp_path / "d.txt"
    t.write_text("line one\nline two\n")
    assert texts_from(str(t), tok) == ["line one", "line two"]
    c = tmp_path / "chat.jsonl"
    c.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "hello"}]}) + "\n")
    assert texts_from(str(c), tok) == ["<s>user\nhi</s>\n<s>assistant\nhello</s>\n"]
    with pytest.raises(DataError, match="no 'body' column"):
        texts_from(str(p), tok, text_field="body")


def test_bad_datasets_name_the_fix(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        build_data(tok, dataset=str(tmp_path / "missing.jsonl"), seq_len=8, eval_blocks=1)
    small = tmp_path / "s.txt"
    small.write_text("tiny\n")
    with pytest.raises(DataError, match="training blocks"):
        build_data(tok, dataset=str(small), seq_len=64, eval_blocks=1, min_train_blocks=4)


def test_builtin_build(tok):
    data = build_data(tok, dataset=BUILTIN, seq_len=32, eval_blocks=4, max_train_blocks=20)
    assert data.train.shape == (20, 32) and data.eval.shape == (4, 32)
