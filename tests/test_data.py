import sys

import numpy as np
import pytest
import torch

from frugal_kernels.lab.corpus import (
    NOISE_KINDS,
    ByteTokenizer,
    Document,
    TokenDataset,
    _is_validation,
    add_noise,
    load_corpus,
    stdlib_documents,
    text_file_documents,
)

MAX_BYTES = 2_000_000


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=MAX_BYTES)


def test_stdlib_corpus_is_capped_sorted_and_without_tests():
    documents = stdlib_documents(max_bytes=MAX_BYTES)
    names = [doc.name for doc in documents]
    assert names == sorted(names)
    assert sum(len(doc.data) for doc in documents) == MAX_BYTES
    assert all(name.endswith(".py") for name in names)
    for name in names:
        parts = set(name.split("/")[:-1])
        assert not parts & {"test", "tests", "site-packages"}, name


def test_stdlib_corpus_is_deterministic(corpus):
    again = load_corpus(max_bytes=MAX_BYTES)
    assert again.digest == corpus.digest
    assert torch.equal(again.train, corpus.train)
    assert torch.equal(again.validation, corpus.validation)


def test_split_is_by_document_and_disjoint(corpus):
    documents = stdlib_documents(max_bytes=MAX_BYTES)
    assert corpus.split_rule == "documents"
    assert len(corpus.train) + len(corpus.validation) == MAX_BYTES
    assert 0.01 < len(corpus.validation) / MAX_BYTES < 0.3
    # Rebuilding the split from the documents shows each one went to exactly one side.
    by_content = {doc.data: doc.name for doc in documents if len(doc.data) > 2000}
    train_bytes = corpus.train.numpy().tobytes()
    val_bytes = corpus.validation.numpy().tobytes()
    in_train = {name for data, name in by_content.items() if data in train_bytes}
    in_val = {name for data, name in by_content.items() if data in val_bytes}
    assert in_val and in_train
    assert not in_train & in_val
    assert in_train | in_val == set(by_content.values())


def test_split_depends_on_seed(corpus):
    other = load_corpus(max_bytes=MAX_BYTES, seed=1)
    assert not torch.equal(other.validation[:1000], corpus.validation[:1000])


def test_batches_are_deterministic(corpus):
    first = list(corpus.batches("train", batch_size=4, seq_len=32, seed=3, num_batches=5))
    second = list(corpus.batches("train", batch_size=4, seq_len=32, seed=3, num_batches=5))
    other = list(corpus.batches("train", batch_size=4, seq_len=32, seed=4, num_batches=5))
    assert len(first) == 5
    for (x1, y1), (x2, y2) in zip(first, second):
        assert x1.shape == y1.shape == (4, 32)
        assert x1.dtype == y1.dtype == torch.long
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert torch.equal(x1, y1)  # labels are aligned: the model shifts them
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))


def test_batches_are_windows_of_the_split(corpus):
    train_bytes = corpus.train.numpy().tobytes()
    input_ids, _ = next(corpus.batches("train", batch_size=3, seq_len=64, seed=0))
    for row in input_ids:
        assert bytes(row.tolist()) in train_bytes


def test_validation_batches_are_fixed(corpus):
    a = corpus.validation_batches(batch_size=4, seq_len=64, num_batches=3)
    b = corpus.validation_batches(batch_size=4, seq_len=64, num_batches=3)
    assert len(a) == 3
    for (x1, y1), (x2, y2) in zip(a, b):
        assert x1.shape == (4, 64)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # Spread over the whole split, from its first to its last token.
    assert torch.equal(a[0][0][0], corpus.validation[:64].long())
    assert torch.equal(a[-1][0][-1], corpus.validation[-64:].long())


def test_validation_batches_tile_the_split(corpus):
    everything = corpus.validation_batches(batch_size=4, seq_len=64)
    assert len(everything) == len(corpus.validation) // (4 * 64)
    val_bytes = corpus.validation.numpy().tobytes()
    # Non-overlapping windows in order: each is found at or after where the previous ended.
    position = 0
    for ids, _ in everything:
        for row in ids:
            found = val_bytes.find(bytes(row.tolist()), position)
            assert found >= position
            position = found + 64


def test_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "def f(x):\n    return 'héllo, wörld ✓'\n"
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.long
    assert len(ids) == len(text.encode("utf-8"))
    assert int(ids.max()) < tokenizer.vocab_size == 256
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids.tolist()) == text
    assert tokenizer.decode(tokenizer.encode("")) == ""
    with pytest.raises(ValueError, match="0, 256"):
        tokenizer.decode([65, 256])


def test_user_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bravo " * 200)
    (tmp_path / "a.md").write_text("alpha " * 200)
    (tmp_path / "sub" / "c.py").write_text("charlie = 1\n" * 100)
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01" * 50)
    documents = text_file_documents(tmp_path)
    assert [doc.name for doc in documents] == ["a.md", "b.txt", "sub/c.py"]
    assert documents[0].data == b"alpha " * 200

    data = load_corpus(str(tmp_path), val_fraction=0.2)
    assert len(data.train) + len(data.validation) == 1200 + 1200 + 1200
    input_ids, labels = next(data.batches("train", batch_size=2, seq_len=16))
    assert input_ids.shape == (2, 16)


def test_user_single_file_falls_back_to_tail_split(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("".join(f"line {i}\n" for i in range(1000)))
    data = load_corpus(str(path), val_fraction=0.1)
    assert data.split_rule == "tail"
    tokens = path.read_bytes()
    assert data.train.numpy().tobytes() == tokens[: len(data.train)]
    assert data.validation.numpy().tobytes() == tokens[len(data.train):]
    assert len(data.validation) == len(tokens) // 10


def test_user_path_is_capped(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 1000)
    (tmp_path / "b.txt").write_text("b" * 1000)
    documents = text_file_documents(tmp_path, max_bytes=1500)
    assert [doc.data for doc in documents] == [b"a" * 1000, b"b" * 500]


def test_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
        load_corpus(str(missing))


def test_directory_without_text_is_a_clear_error(tmp_path):
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="no .txt/.md/.py files"):
        load_corpus(str(tmp_path))


def test_hf_source_without_datasets_is_a_clear_error(monkeypatch):
    # A None entry in sys.modules makes `import datasets` fail, installed or not.
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="needs the optional package 'datasets'"):
        load_corpus("hf:wikitext:wikitext-2-raw-v1")


def test_too_long_sequences_are_rejected():
    data = TokenDataset([Document("a", b"x" * 100), Document("b", b"y" * 100)], seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        next(data.batches("train", seq_len=1000))
    with pytest.raises(ValueError, match="split must be"):
        next(data.batches("test"))


def test_default_corpus_is_8_megabytes():
    data = load_corpus()
    assert data.source == "stdlib"
    assert len(data.train) + len(data.validation) == 8_000_000
    assert data.train.dtype == torch.uint8


def _docs(n=40, size=300):
    rng = np.random.default_rng(0)
    return [Document(f"d{i}.py", bytes(f"def f{i}(x):\n    return x * {i}\n" * (size // 30),
                                       "ascii") + bytes(rng.integers(97, 123, 5))) for i in range(n)]


def test_noise_replaces_the_fraction_with_shuffles_and_duplicates_of_the_same_length():
    docs = _docs()
    noised = add_noise(docs, 0.4, seed=1)
    changed = [(a, b) for a, b in zip(docs, noised) if a.data != b.data]
    assert 0.2 * len(docs) <= len(changed) <= 0.6 * len(docs)
    clean = {d.data for a, d in zip(docs, noised) if a.data == d.data}
    shuffled = [b for a, b in changed if sorted(a.data) == sorted(b.data)]
    duplicated = [b for a, b in changed if any(c.startswith(b.data[:len(c)]) or
                                               b.data.startswith(c) for c in clean)]
    assert shuffled and duplicated and len(shuffled) + len(duplicated) == len(changed)
    assert all(len(a.data) == len(b.data) and a.name == b.name for a, b in zip(docs, noised))
    assert add_noise(docs, 0.4, seed=1) == noised          # deterministic
    assert add_noise(docs, 0.0) == docs


def test_noise_touches_only_the_training_split():
    docs = _docs()
    plain = TokenDataset(docs, val_fraction=0.2, seed=3)
    noisy = TokenDataset(docs, val_fraction=0.2, seed=3, noise=0.5)
    assert torch.equal(plain.validation, noisy.validation)
    assert len(plain.train) == len(noisy.train) and not torch.equal(plain.train, noisy.train)
    assert noisy.noised_documents > 0 and noisy.digest != plain.digest
    assert "noise=0.5" in repr(noisy)


@pytest.mark.parametrize("fraction", [-0.1, 1.0, float("nan"), True, "0.3"])
def test_a_bad_noise_fraction_is_refused(fraction):
    with pytest.raises(ValueError, match="noise fraction"):
        TokenDataset(_docs(), noise=fraction)


def _kind_of(original: bytes, noised: bytes) -> str:
    if noised == original:
        return "clean"
    return "shuffled" if sorted(noised) == sorted(original) else "duplicate"


def test_a_windows_noise_label_is_what_most_of_its_bytes_came_from():
    """Each byte's kind from its document (kept, shuffled, or another's text), the windows'
    starts from the documented generator: the label is the kind of more than half the bytes."""
    docs = _docs(n=60, size=150)
    plain = TokenDataset(docs, val_fraction=0.2, seed=3)
    noisy = TokenDataset(docs, val_fraction=0.2, seed=3, noise=0.5)
    train_docs = [d for d in docs if not _is_validation(d.name, 3, 0.2)]
    per_byte = []
    offset = 0
    for doc in train_docs:
        noised = bytes(noisy.train[offset:offset + len(doc.data)].tolist())
        per_byte += [NOISE_KINDS.index(_kind_of(doc.data, noised))] * len(doc.data)
        offset += len(doc.data)
    assert offset == len(plain.train) == len(noisy.train)
    assert {"shuffled", "duplicate"} <= {NOISE_KINDS[k] for k in per_byte}
    per_byte = torch.tensor(per_byte)
    seq_len, batch = 64, 8
    generator = torch.Generator().manual_seed(11)
    seen = torch.zeros(len(NOISE_KINDS), dtype=torch.int64)
    for ids, labels, noise in noisy.batches("train", batch, seq_len, seed=11, num_batches=20,
                                            with_noise=True):
        starts = torch.randint(0, len(noisy.train) - seq_len + 1, (batch,), generator=generator)
        for row, start, label in zip(ids, starts.tolist(), noise.tolist()):
            assert row.tolist() == noisy.train[start:start + seq_len].tolist()
            counts = torch.bincount(per_byte[start:start + seq_len], minlength=3)
            expected = next((k for k in (1, 2) if 2 * counts[k] > seq_len), 0)
            assert label == expected
            seen[label] += 1
    assert (seen > 0).all(), seen  # every kind labelled somewhere
    # without with_noise, the same windows
    first = next(noisy.batches("train", batch, seq_len, seed=11))
    assert torch.equal(first[0], next(noisy.batches("train", batch, seq_len, seed=11,
                                                    with_noise=True))[0])


def test_a_clean_corpus_labels_every_window_clean(corpus):
    _, _, noise = next(corpus.batches("train", 8, 32, seed=0, with_noise=True))
    assert noise.tolist() == [0] * 8
