"""The peers' rows of the demo (frugal_kernels.lab.peers): built on the demo's split, stepped,
skipped with a notice without their package, and counted to the byte in the memory columns."""

import dataclasses
import sys

import pytest
import torch

from frugal_kernels.lab import demo, peers, registry
from frugal_kernels.__main__ import main
from frugal_kernels.lab.corpus import load_corpus
from frugal_kernels.model import LlamaForCausalLM
from frugal_kernels.lab.train import TrainConfig, lr_groups, step_memory, train

MAX_BYTES = 200_000
TINY = TrainConfig(model="tiny", steps=6, batch_size=2, seq_len=16, warmup_steps=2,
                   eval_every=3, eval_batches=1, max_bytes=MAX_BYTES, lr=1e-2,
                   matrix_lr_ratio=0.25)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=MAX_BYTES)


def _needs(name):
    pytest.importorskip(peers.PEERS[name]["requires"][0])


def _stepped(name, corpus, steps=1):
    """A tiny model and the peer's optimizer after ``steps`` steps, gradients still held."""
    model = LlamaForCausalLM(TINY.model_config(corpus.vocab_size))
    opt = demo.OPTIMIZERS[name].make(model, TINY)
    batches = corpus.batches("train", 2, 16, seed=0)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(*next(batches)).loss.backward()
        opt.step()
    return model, opt


def test_every_peer_is_a_demo_row():
    for name, spec in peers.PEERS.items():
        row = demo.OPTIMIZERS[name]
        assert (row.label, row.requires) == (spec["label"], spec["requires"])
        assert (row.make is spec["make"]) != spec.get("subspace", False)


@pytest.mark.parametrize("name", list(peers.PEERS))
def test_peer_gets_the_demo_split_and_trains(name, corpus):
    _needs(name)
    model, opt = _stepped(name, corpus)
    split = {id(p): g["lr"] for g in lr_groups(model, TINY) for p in g["params"]}
    got = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert got == split and set(split.values()) == {1e-2, 2.5e-3}
    result = train(TINY, demo.OPTIMIZERS[name].make, data=corpus, progress=False)
    assert result.steps_done == TINY.steps
    assert result.final_val_loss < result.evaluations[0]["val_loss"]


@pytest.mark.parametrize("name", ["galore", "apollo"])
def test_low_rank_peers_project_the_matrices_at_rank_d_over_4(name, corpus):
    _needs(name)
    model, opt = _stepped(name, corpus)
    projected = [g for g in opt.param_groups if g["projected"]]
    assert [g["rank"] for g in projected] == [model.config.hidden_size // 4]
    assert projected[0]["update_proj_gap"] == registry.UPDATE_GAP
    for p in projected[0]["params"]:
        assert min(opt.state[p]["exp_avg"].shape) == model.config.hidden_size // 4
    for g in opt.param_groups:
        if not g["projected"]:
            assert "rank" not in g


@pytest.mark.parametrize("name", ["galore", "apollo"])
def test_subspace_peers_change_their_subspace_at_the_demos_t(name, corpus, monkeypatch):
    _needs(name)
    monkeypatch.setattr(registry, "UPDATE_GAP", 7)
    model, opt = _stepped(name, corpus)
    assert [g["update_proj_gap"] for g in opt.param_groups if g["projected"]] == [7]


def test_a_missing_package_skips_its_row_with_one_notice(tmp_path, monkeypatch, capsys):
    # None in sys.modules makes `import galore_torch` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "galore_torch", None)
    assert "galore-torch cannot be imported" in peers.missing(peers.PEERS["galore"]["requires"])
    config = dataclasses.replace(TINY, steps=2, eval_every=2)
    metrics = demo.run_demo(config, ["adamw", "galore"], out=tmp_path / "run", progress=False)
    assert list(metrics["runs"]) == ["adamw"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("skipping galore: galore-torch cannot be imported")
    assert 'pip install "frugal_kernels[peers]"' in err[0]

    # The train command names the missing package in one line, exit status 2.
    assert main(["train", "--optimizer", "galore", "--model", "tiny", "--steps", "2",
                 "--max-bytes", str(MAX_BYTES), "--quiet", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "'galore' cannot run here: galore-torch cannot be imported" in err[0]


def _storage_nbytes(tensors):
    """Bytes of the distinct storages behind ``tensors`` (a slice keeps its whole storage)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _expected_state(name, opt):
    """The state tensors each peer keeps, listed from its own layout."""
    tensors = []
    for p, st in opt.state.items():
        if name in ("galore", "apollo"):
            tensors += [st["exp_avg"], st["exp_avg_sq"]]
            if "projector" in st:
                tensors.append(st["projector"].ortho_matrix)
            if "scaled_grad" in st:  # APOLLO's norm-growth limiter
                tensors.append(st["scaled_grad"])
        elif name == "adam-mini":
            tensors += [st[k] for k in ("m", "v", "vmean") if k in st]
        else:  # bitsandbytes: uint8 moments with their block maxima and code books
            tensors += [st[k] for k in ("state1", "state2", "absmax1", "absmax2", "qmap1",
                                        "qmap2") if k in st]
    return tensors


@pytest.mark.parametrize("name", list(peers.PEERS))
def test_memory_columns_count_the_peers_state(name, corpus):
    _needs(name)
    model, opt = _stepped(name, corpus, steps=2)
    params = list(model.parameters())
    state = _expected_state(name, opt)
    memory = step_memory(model, opt)
    assert memory["weight_bytes"] == _nbytes(params)
    assert memory["grad_bytes"] == _nbytes(p.grad for p in params)
    assert memory["state_bytes"] == _storage_nbytes(state)
    assert memory["held_bytes"] == 2 * _nbytes(params) + _storage_nbytes(state)
    if name == "adamw8bit":
        # 8-bit moments: one byte per coordinate for the tensors bitsandbytes quantizes.
        big = [p for p in params if p.numel() >= 4096]
        assert big and all(opt.state[p]["state1"].dtype == torch.uint8 for p in big)
        assert memory["state_bytes"] < 2 * _nbytes(big) / 4 + 2 * _nbytes(
            p for p in params if p.numel() < 4096) + 2**16
    if name == "galore":
        # GaLore keeps a slice of the SVD factor; the factor's whole storage stays alive.
        projector = next(st["projector"] for st in opt.state.values() if "projector" in st)
        ortho = projector.ortho_matrix
        assert ortho.untyped_storage().nbytes() >= _nbytes([ortho])
