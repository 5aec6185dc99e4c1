"""A hub model is pinned to its commit: two commits of one model never share a cached row.

No network here, so the hub is a local HuggingFace cache laid out as ``huggingface_hub``
lays it (``models--<org>--<name>/refs/main`` naming a commit, ``snapshots/<commit>/`` its
files) and read with ``HF_HUB_OFFLINE=1``: the same resolution of a branch to a commit that
``huggingface_hub.snapshot_download`` does offline (online it asks the hub's API instead,
which this suite cannot reach). The snapshots hold files rather than links into ``blobs/``;
loaders read either.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from lmqueue import QueueLM
from lmqueue.devstack import WorkerProcess
from lmqueue.shared.errors import SettingsError, UnknownModel
from lmqueue.workers import models

REPO = "lmq-test/tiny-llama"


def _commit(label: str) -> str:
    return hashlib.sha1(label.encode()).hexdigest()


def _save_commit(hub: Path, label: str, seed: int, tokenizer: Any) -> str:
    """A tiny random Llama (weights from `seed`) as the snapshot of commit `label`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    commit = _commit(label)
    snapshot = hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    LlamaForCausalLM(config).eval().save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    return commit


def _point_main_at(hub: Path, commit: str) -> None:
    refs = hub / f"models--{REPO.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text(commit)  # huggingface_hub writes the bare hash, no newline


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, smol_tokenizer: Any) -> dict[str, Any]:
    """A local hub cache with two commits of one model, main at the first."""
    root = tmp_path_factory.mktemp("hf-hub")
    old = _save_commit(root, "old weights", 1, smol_tokenizer)
    new = _save_commit(root, "new weights", 2, smol_tokenizer)
    _point_main_at(root, old)
    return {"root": root, "old": old, "new": new}


@pytest.fixture
def offline_hub(hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """`hub` as this process's offline hub cache; main at the old commit; nothing memoized."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["root"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _point_main_at(hub["root"], hub["old"])
    models.hub_snapshot.cache_clear()
    yield hub
    models.hub_snapshot.cache_clear()


def test_a_hub_model_is_pinned_to_the_commit_its_branch_names(offline_hub: dict[str, Any]) -> None:
    spec = models.resolve_model(REPO)
    assert spec.revision == f"hub-{offline_hub['old']}"
    assert Path(spec.source).name == offline_hub["old"] and spec.repo_id == REPO
    assert Path(models.hf_directory(REPO)) == Path(spec.source)


def test_the_branch_is_resolved_once_per_process(offline_hub: dict[str, Any]) -> None:
    before = models.resolve_model(REPO).revision
    _point_main_at(offline_hub["root"], offline_hub["new"])  # moves while the worker starts
    assert models.resolve_model(REPO).revision == before  # tokenizer, weights: one commit
    models.hub_snapshot.cache_clear()  # the next process
    assert models.resolve_model(REPO).revision == f"hub-{offline_hub['new']}"


def test_a_commit_or_ref_named_in_the_model_is_used(offline_hub: dict[str, Any]) -> None:
    new = offline_hub["new"]
    assert models.resolve_model(f"{REPO}@{new}").revision == f"hub-{new}"
    with pytest.raises(UnknownModel, match=f"{REPO}@no-such-branch cannot be resolved"):
        models.resolve_model(f"{REPO}@no-such-branch")


def test_a_revision_in_engine_opts_is_refused_for_the_model_name(
    offline_hub: dict[str, Any],
) -> None:
    with pytest.raises(SettingsError, match=f"name the revision in the model instead, {REPO}@REF"):
        models.load_causal_lm(REPO, {"revision": "v2"})


def _cached_revisions(url: str) -> set[str]:
    """The model revisions the shared cache holds rows of (``...:cache:<model>:<rev>:...``)."""
    client = redis.Redis.from_url(url)
    try:
        keys = [k.decode() for k in client.scan_iter(match="lmq:*:cache:*")]
    finally:
        client.close()
    return {key.split(f":{REPO}:")[1].split(":")[0] for key in keys if f":{REPO}:" in key}


async def _row(url: str, prompt: list[int]) -> torch.Tensor:
    async with await QueueLM.connect(REPO, redis_url=url, connect_timeout_s=90) as lm:
        return await lm.next_token_logprobs(prompt)


def _reference(snapshot: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(snapshot).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


async def _serve(hub: dict[str, Any], url: str, name: str, log_dir: Path) -> WorkerProcess:
    """A real hf worker on the offline hub, returned once it serves (its model published)."""
    env = {"HF_HUB_CACHE": str(hub["root"]), "HF_HUB_OFFLINE": "1"}
    worker = WorkerProcess(REPO, "hf", url, name, env=env, log_dir=log_dir).start()
    deadline = time.monotonic() + 120
    while f"serving {REPO}" not in worker.log():
        assert worker.alive and time.monotonic() < deadline, worker.log()
        await asyncio.sleep(0.2)
    return worker


async def test_two_hub_commits_of_one_model_never_share_a_cached_row(
    hub: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    """Real worker processes: main at the old commit, a row cached; main moves; a worker
    started then computes the row of the new weights instead of serving the cached one."""
    root, old, new = hub["root"], hub["old"], hub["new"]
    prompt = [1, 504, 3458, 282, 4649, 314]
    _point_main_at(root, old)
    first = await _serve(hub, redis_url, "old", tmp_path)
    try:
        row_old = await _row(redis_url, prompt)
    finally:
        assert first.stop() == 0, first.log()
    assert _cached_revisions(redis_url) == {f"hub-{old}"}

    _point_main_at(root, new)  # the upstream weights change
    second = await _serve(hub, redis_url, "new", tmp_path)
    try:
        row_new = await _row(redis_url, prompt)
    finally:
        assert second.stop() == 0, second.log()
    assert _cached_revisions(redis_url) == {f"hub-{old}", f"hub-{new}"}

    snapshots = root / f"models--{REPO.replace('/', '--')}" / "snapshots"
    reference_old, reference_new = await asyncio.to_thread(
        lambda: (_reference(snapshots / old, prompt), _reference(snapshots / new, prompt))
    )
    assert torch.allclose(row_old, reference_old, atol=1e-4)
    assert torch.allclose(row_new, reference_new, atol=1e-4)
    assert (row_new - row_old).abs().max() > 0.1  # different weights, different rows
    assert f"hub model {REPO}@main is commit {new}" in second.log()
