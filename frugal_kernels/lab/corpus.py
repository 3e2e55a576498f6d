"""Byte-level text data for the training examples, with a default that needs no download.

The default corpus is the Python standard library's own source code: every machine with
Python has it, so a training run is reproducible offline. Text is tokenized to bytes
(vocabulary 256). A source is chosen with :func:`load_corpus`:

* ``None`` or ``"stdlib"``: the ``*.py`` files of the standard library (:func:`stdlib_documents`);
* a path: a text file, or a directory searched recursively (:func:`text_file_documents`);
* ``"hf:NAME"`` or ``"hf:NAME:CONFIG"``: a Hugging Face dataset, only when the optional
  ``datasets`` package is installed (:func:`hf_documents`). It may download; nothing else does.

Example::

    data = load_corpus()                       # or load_corpus("notes/"), load_corpus("hf:...")
    for input_ids, labels in data.batches("train", batch_size=8, seq_len=128, seed=0):
        ...
    val = data.validation_batches(batch_size=8, seq_len=128, num_batches=4)
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "NOISE_KINDS",
    "TEXT_SUFFIXES",
    "ByteTokenizer",
    "Document",
    "TokenDataset",
    "add_noise",
    "stdlib_documents",
    "text_file_documents",
    "hf_documents",
    "load_corpus",
]

DEFAULT_MAX_BYTES = 8_000_000
# What a training byte is, by its code in TokenDataset.train_noise and a window's label.
NOISE_KINDS = ("clean", "shuffled", "duplicate")
TEXT_SUFFIXES = (".txt", ".md", ".py")

# Directory names never read from the standard library: the test suites are mostly data
# and fixtures, and site-packages holds whatever the user installed, not the stdlib.
_STDLIB_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


class Document(NamedTuple):
    """One unit of the train/validation split: a name (a relative path) and its bytes."""

    name: str
    data: bytes


class ByteTokenizer:
    """Text to UTF-8 bytes and back: token ids are the byte values 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as a 1-D int64 tensor of its UTF-8 bytes."""
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return torch.from_numpy(data.astype(np.int64))

    def decode(self, ids: Union[torch.Tensor, Sequence[int]]) -> str:
        """Bytes back to text; a multi-byte character cut by a window edge decodes to U+FFFD."""
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"byte token ids must lie in [0, {self.vocab_size}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        return ids.to(torch.uint8).numpy().tobytes().decode("utf-8", errors="replace")


def _read_capped(root: Path, files: Sequence[Path], max_bytes: Optional[int]) -> list[Document]:
    """Read ``files`` in order until ``max_bytes`` is reached; the last one is cut to fit."""
    documents = []
    used = 0
    for index, path in enumerate(files):
        with open(path, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes - used)
            full = max_bytes is not None and used + len(data) >= max_bytes
            cut = full and (bool(f.read(1)) or index + 1 < len(files))
        used += len(data)
        documents.append(Document(path.relative_to(root).as_posix(), data))
        if full:
            if cut:
                logger.info("read the first %d bytes of %s (max_bytes)", max_bytes, root)
            break
    return documents


def stdlib_documents(max_bytes: Optional[int] = DEFAULT_MAX_BYTES) -> list[Document]:
    """The standard library's ``*.py`` files, sorted by relative path, up to ``max_bytes``.

    Test directories and site-packages are left out. The selection depends only on the Python
    version (and on what the distribution ships of the standard library), so it is the same
    on every such machine; :attr:`TokenDataset.digest` identifies it.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruned in place so that os.walk never descends into site-packages or test suites.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    files.sort(key=lambda path: path.relative_to(root).as_posix())
    return _read_capped(root, files, max_bytes)


def text_file_documents(
    path: Union[str, os.PathLike],
    max_bytes: Optional[int] = None,
    suffixes: Sequence[str] = TEXT_SUFFIXES,
) -> list[Document]:
    """The user's own text: one file, or every file under a directory with one of ``suffixes``.

    A directory is searched recursively and read in sorted order of relative path, up to
    ``max_bytes`` (no limit by default).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data path {str(path)!r} does not exist")
    if path.is_file():
        return _read_capped(path.parent, [path], max_bytes)
    if not path.is_dir():  # /dev/null, a pipe, a socket: no text to split and sample
        raise ValueError(f"data path {str(path)!r} is neither a file nor a folder")
    files = sorted(
        (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in suffixes),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise ValueError(f"no {'/'.join(suffixes)} files found under {str(path)!r}")
    return _read_capped(path, files, max_bytes)


def hf_documents(
    spec: str, max_bytes: Optional[int] = DEFAULT_MAX_BYTES, text_column: str = "text"
) -> list[Document]:
    """Rows of the ``train`` split of a Hugging Face dataset, as UTF-8 documents.

    ``spec`` is ``"NAME"`` or ``"NAME:CONFIG"`` (e.g. ``"wikitext:wikitext-2-raw-v1"``); NAME may
    contain an organisation (``"roneneldan/TinyStories"``). This needs the optional
    ``datasets`` package and downloads, which is why it only runs when asked for. The split is
    streamed, so only the rows up to ``max_bytes`` are fetched, even from a corpus like C4.
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"the data source 'hf:{spec}' needs the optional package 'datasets', which is not "
            "installed (pip install datasets); without it, use the default standard-library "
            "corpus or a local path"
        ) from e
    name, _, config = spec.partition(":")
    rows = datasets.load_dataset(name, config or None, split="train", streaming=True)
    documents = []
    remaining = max_bytes
    for index, row in enumerate(rows):
        if remaining is not None and remaining <= 0:
            break
        data = row[text_column].encode("utf-8")
        if remaining is not None:
            data = data[:remaining]
            remaining -= len(data)
        documents.append(Document(f"{name}/{index}", data))
    return documents


def _is_validation(name: str, seed: int, val_fraction: float) -> bool:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


def _hash_fraction(key: str) -> float:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def add_noise(documents: Sequence[Document], fraction: float, seed: int = 0) -> list[Document]:
    """``documents`` with a ``fraction`` of them replaced by low-value text of the same length.

    The setting where online data selection is said to pay (docs/ops.md, OnlineSelector): a
    document is noised when a hash of its name and ``seed`` falls under ``fraction`` (so the
    choice is deterministic and independent of the other files), and becomes either its own
    bytes in a seeded random order (unigram statistics kept, structure gone: unlearnable) or
    an exact duplicate, the start of another clean document repeated to the length (learnable
    once, then worth nothing), alternately by a second hash. Names are kept, so the
    train/validation split is the same as without noise; callers noise only the training
    split, so that the validation loss stays a measure on clean text.
    """
    return _noised(documents, fraction, seed)[0]


def _noised(documents: Sequence[Document], fraction: float,
            seed: int) -> tuple[list[Document], list[int]]:
    """:func:`add_noise`'s documents and each one's code in :data:`NOISE_KINDS`."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or \
            not 0.0 <= fraction < 1.0:
        raise ValueError(f"the noise fraction must lie in [0, 1), got {fraction!r}")
    noised = [_hash_fraction(f"noise:{seed}:{doc.name}") < fraction for doc in documents]
    clean = [doc for doc, n in zip(documents, noised) if not n and doc.data]
    out, kinds = [], []
    for doc, noise in zip(documents, noised):
        if not noise or not doc.data:
            out.append(doc)
            kinds.append(0)
            continue
        key = f"noise-kind:{seed}:{doc.name}"
        if clean and _hash_fraction(key) < 0.5:
            source = clean[int(_hash_fraction(key + ":source") * len(clean))].data
            repeats = -(-len(doc.data) // len(source))
            data = (source * repeats)[:len(doc.data)]
            kinds.append(NOISE_KINDS.index("duplicate"))
        else:
            generator = np.random.default_rng(int.from_bytes(
                hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))
            data = generator.permutation(np.frombuffer(doc.data, dtype=np.uint8)).tobytes()
            kinds.append(NOISE_KINDS.index("shuffled"))
        out.append(Document(doc.name, data))
    return out, kinds


def _window_labels(kinds: torch.Tensor) -> torch.Tensor:
    """``[B]``: the kind filling more than half of each row of ``kinds`` ``[B, T]``, else 0."""
    label = torch.zeros(kinds.shape[0], dtype=torch.int64)
    for code in range(1, len(NOISE_KINDS)):
        label[2 * (kinds == code).sum(1) > kinds.shape[1]] = code
    return label


def _to_tokens(chunks: Sequence[bytes]) -> torch.Tensor:
    # Bytes are their own token ids: one buffer copy, no Python loop over tokens.
    return torch.from_numpy(np.frombuffer(b"".join(chunks), dtype=np.uint8).copy())


class TokenDataset:
    """Train and validation token streams (uint8 byte ids) with deterministic batching.

    The split is by document: a document goes to validation when a hash of its name and
    ``seed`` falls under ``val_fraction``, so a file never straddles the two splits and adding
    files does not move the others. ``val_fraction`` is thus a fraction of the documents; the
    fraction of bytes varies with their sizes (8% of the default 8 MB at 0.05). When the hash
    leaves a split empty (a corpus of one file or a handful), the last ``val_fraction`` of the
    concatenated bytes is validation instead. Within a split, documents are concatenated in
    their given order.

    ``noise`` replaces that fraction of the training documents by low-value text
    (:func:`add_noise`); validation stays clean. ``train_noise`` holds, per training byte,
    what it is (its code in :data:`NOISE_KINDS`: 0 clean, 1 shuffled, 2 duplicate), from
    which :meth:`batches` labels its windows (``with_noise``).
    """

    def __init__(
        self,
        documents: Sequence[Document],
        val_fraction: float = 0.05,
        seed: int = 0,
        source: str = "",
        noise: float = 0.0,
    ) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
        if not any(doc.data for doc in documents):
            raise ValueError(f"data source {source!r} holds no text")
        self.source = source
        self.seed = seed
        self.val_fraction = val_fraction
        self.tokenizer = ByteTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        in_val = [_is_validation(doc.name, seed, val_fraction) for doc in documents]
        train_docs, kinds = _noised([doc for doc, v in zip(documents, in_val) if not v],
                                    noise, seed)
        train = [doc.data for doc in train_docs]
        val = [doc.data for doc, v in zip(documents, in_val) if v]
        if any(train) and any(val):
            self.train, self.validation = _to_tokens(train), _to_tokens(val)
            self.train_noise = torch.from_numpy(np.repeat(
                np.array(kinds, dtype=np.uint8), [len(data) for data in train]))
            self.split_rule = "documents"
        else:
            if noise:
                raise ValueError(f"noise={noise} needs a corpus split by documents; "
                                 f"{source!r} has too few to split")
            tokens = _to_tokens([doc.data for doc in documents])
            cut = len(tokens) - max(1, int(len(tokens) * val_fraction))
            self.train, self.validation = tokens[:cut], tokens[cut:]
            self.train_noise = torch.zeros(len(self.train), dtype=torch.uint8)
            self.split_rule = "tail"
        self.num_documents = len(documents)
        self.noise = float(noise)
        self.noised_documents = sum(kind != 0 for kind in kinds)
        # Of what is trained and validated on: a noised corpus is another corpus.
        self.digest = hashlib.sha256(b"".join(train + val)).hexdigest() if noise else \
            hashlib.sha256(b"".join(doc.data for doc in documents)).hexdigest()

    def tokens(self, split: str) -> torch.Tensor:
        if split == "train":
            return self.train
        if split == "validation":
            return self.validation
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")

    def _check_length(self, split: str, seq_len: int) -> int:
        num_tokens = len(self.tokens(split))
        if seq_len <= 1 or seq_len > num_tokens:
            raise ValueError(
                f"seq_len must lie in [2, {num_tokens}] for the {split} split of "
                f"{self.source!r} ({num_tokens} tokens), got {seq_len}"
            )
        return num_tokens

    def batches(
        self,
        split: str = "train",
        batch_size: int = 8,
        seq_len: int = 128,
        seed: int = 0,
        device: Union[str, torch.device] = "cpu",
        num_batches: Optional[int] = None,
        skip: int = 0,
        with_noise: bool = False,
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Random windows of the split: ``(input_ids, labels)``, int64, shape ``[B, T]``.

        Each window starts at a uniformly random offset drawn from a generator seeded with
        ``seed``, so the sequence of batches is the same on every run and every device. The
        iterator is endless unless ``num_batches`` is given. ``labels`` equals ``input_ids``:
        :class:`~frugal_kernels.model.LlamaForCausalLM` shifts them itself. ``skip`` passes
        over the first batches of the sequence (drawing only their offsets), so that a resumed
        run goes on with the batches it would have seen. ``with_noise`` adds a third item,
        each window's label ``[B]`` (int64): the code in :data:`NOISE_KINDS` of the noise
        that fills more than half of its bytes, 0 (clean) where none does; the windows are
        the same as without it.
        """
        num_tokens = self._check_length(split, seq_len)
        tokens = self.tokens(split)
        kinds = self.train_noise if split == "train" else torch.zeros_like(tokens)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(skip):
            torch.randint(0, num_tokens - seq_len + 1, (batch_size,), generator=generator)
        produced = 0
        while num_batches is None or produced < num_batches:
            starts = torch.randint(0, num_tokens - seq_len + 1, (batch_size,), generator=generator)
            window = starts[:, None] + torch.arange(seq_len)
            input_ids = tokens[window].long().to(device)
            # Labels follow the Hugging Face convention the model expects: aligned with the
            # inputs, shifted inside the loss.
            if not with_noise:
                yield input_ids, input_ids.clone()
            else:
                yield input_ids, input_ids.clone(), _window_labels(kinds[window]).to(device)
            produced += 1

    def validation_batches(
        self,
        batch_size: int = 8,
        seq_len: int = 128,
        num_batches: Optional[int] = None,
        device: Union[str, torch.device] = "cpu",
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed evaluation set: ``num_batches`` batches (default: as many as the split holds)
        of non-overlapping windows spread evenly over the validation split.

        Even spacing makes a few batches represent the whole split rather than its first
        documents. No randomness is involved, so every call returns the same batches.
        """
        num_tokens = self._check_length("validation", seq_len)
        available = num_tokens // (seq_len * batch_size)
        if available == 0:
            raise ValueError(
                f"the validation split ({num_tokens} tokens) holds no full batch of "
                f"{batch_size} x {seq_len}"
            )
        count = available if num_batches is None else min(num_batches, available)
        # Spacing (num_tokens - seq_len) / (windows - 1) is at least seq_len, since
        # windows * seq_len <= num_tokens: the windows never overlap.
        starts = torch.linspace(0, num_tokens - seq_len, count * batch_size, dtype=torch.float64)
        windows = self.validation[starts.long()[:, None] + torch.arange(seq_len)].long()
        return [(ids, ids.clone()) for ids in windows.to(device).split(batch_size)]

    def __repr__(self) -> str:
        return (f"TokenDataset(source={self.source!r}, documents={self.num_documents}, "
                f"train_tokens={len(self.train)}, validation_tokens={len(self.validation)}, "
                f"split={self.split_rule!r}"
                + (f", noise={self.noise}, noised_documents={self.noised_documents}"
                   if self.noise else "") + ")")


def load_corpus(
    source: Optional[str] = None,
    *,
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
    val_fraction: float = 0.05,
    seed: int = 0,
    noise: float = 0.0,
) -> TokenDataset:
    """A :class:`TokenDataset` from ``source`` (see the module docstring for the forms).

    ``max_bytes`` caps what is read from any source, the user's files included (``None``: no
    cap); a cut is logged. ``seed`` fixes the train/validation split and the noised documents;
    ``noise`` is the fraction of training documents replaced by low-value text
    (:func:`add_noise`).
    """
    if source is None or source == "stdlib":
        documents = stdlib_documents(max_bytes)
        source = "stdlib"
    elif source.startswith("hf:"):
        documents = hf_documents(source[len("hf:"):], max_bytes)
    else:
        documents = text_file_documents(source, max_bytes)
    return TokenDataset(documents, val_fraction=val_fraction, seed=seed, source=source,
                        noise=noise)
