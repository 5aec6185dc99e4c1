"""``lmq bench trie``: trie masses of a batch of distributions, lmqueue against genlm-backend 0.3.1.

    lmq bench trie [--batch 32] [--repeats 9] [--warmup 2]

One run times `batch_weight_sum` and `batch_weight_max` of lmqueue's
`ParallelTokenCharacterTrie` (CPU) and of genlm-backend's `TokenCharacterTrie` (numba, one row
at a time) and `ParallelTokenCharacterTrie` (torch sparse matmul / scatter, float32), over the
same batch of SmolLM2 next-token distributions: the model's own, computed at the start of the
run by one forward over the benchmark text (each row is the distribution after one of its
prefixes), so the mass sits on few tokens as in real use. Calls are interleaved round-robin so
a busy machine slows every contender alike; each figure is the median after warm-up. genlm's torch
trie is timed with torch's default thread count and with one thread, and the faster counts.
Each trie gets the input it prefers: float64 numpy for lmqueue's and genlm's sequential trie,
a float32 torch tensor for genlm's torch trie (which computes in float32).

Results are compared node by node (matched by prefix and token) with genlm's float64
sequential trie and with a float64 reference that reduces each node's tokens directly, in byte
order (another summation order than any trie's). genlm's sequential `weight_max` clamps inner
nodes at 0, so maxima are timed and compared on probabilities; log-space maxima are checked
against the reference only. Needs the ``bench`` extra. Writes ``<out-dir>/trie.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from lmqueue.shared.lm.trie import ParallelTokenCharacterTrie
from lmqueue.shared.lm.trie.layout import TrieLayout
from lmqueue.shared.lm.vocab import decode_vocab

from .lib.report import DEFAULT_OUT_DIR

__all__ = ["add_arguments", "measure", "report", "run"]


@dataclass
class _Tries:
    """The three tries under test over one vocabulary, and their nodes matched up."""

    ours: ParallelTokenCharacterTrie
    genlm_seq: Any
    genlm_par: Any
    ours_nodes: np.ndarray
    genlm_nodes: np.ndarray
    build_s: float


def measure(
    batch: int = 32,
    repeats: int = 9,
    warmup: int = 2,
    model: str = "smollm2-135m",
    seed: int = 0,
) -> dict[str, Any]:
    """Time both operations for every contender; return timings (ms) and differences."""
    import torch

    from lmqueue.workers.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    tries = _build(decode_vocab(tokenizer)[0])
    p = _model_distributions(model, tokenizer, batch, len(tries.ours.decode), seed)
    results: dict[str, Any] = {
        "config": {
            "batch": batch,
            "vocab": len(tries.ours.decode),
            "nodes": tries.ours.num_nodes,
            "repeats": repeats,
            "torch_threads": torch.get_num_threads(),
            "build_s": round(tries.build_s, 2),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
    }
    for op in ("sum", "max"):
        results[op] = _compare(tries, op, p, repeats, warmup, torch)
    diff, wrong = _log_space_max(tries, np.log(p))
    results["max"]["max_rel_diff"]["log-space vs float64 reference"] = diff
    results["max"]["genlm_sequential_log_space_wrong"] = wrong
    return results


def _build(vocab: list[Any]) -> _Tries:
    """lmqueue's CPU trie and genlm's two tries over `vocab`."""
    from genlm.backend.tokenization import Token as GenlmToken
    from genlm.backend.trie import ParallelTokenCharacterTrie as GenlmParallel
    from genlm.backend.trie import TokenCharacterTrie as GenlmSequential

    started = time.perf_counter()
    ours = ParallelTokenCharacterTrie(vocab, device="cpu")
    build_s = time.perf_counter() - started
    genlm_vocab = [GenlmToken(t.token_id, bytes(t)) for t in vocab]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # genlm's sparse-tensor beta warnings
        genlm_seq = GenlmSequential(genlm_vocab)
        genlm_par = GenlmParallel(genlm_vocab, device="cpu")
    ours_nodes, genlm_nodes = _matching_nodes(ours, genlm_seq, genlm_vocab)
    return _Tries(ours, genlm_seq, genlm_par, ours_nodes, genlm_nodes, build_s)


def _compare(
    tries: _Tries, op: str, p: np.ndarray, repeats: int, warmup: int, torch: Any
) -> dict[str, Any]:
    """Timings of `op` for each contender, differences of their results, and the speedup."""
    method = f"batch_weight_{op}"
    # each side its preferred input: float64 numpy for the numpy/numba tries, float32 torch for
    # genlm's torch trie (given float64 it converts every row to float32 itself, ~2-3% of its time)
    tp = torch.from_numpy(p.astype(np.float32))
    contenders = {
        "lmqueue parallel": partial(getattr(tries.ours, method), p),
        "genlm sequential": partial(getattr(tries.genlm_seq, method), p),
        "genlm parallel": partial(getattr(tries.genlm_par, method), tp),
    }
    timings = _time_round_robin(contenders, repeats, warmup, torch)
    expected = _direct_masses(tries.ours.layout, p, op)
    mine = contenders["lmqueue parallel"]()
    ours_nodes, genlm_nodes = tries.ours_nodes, tries.genlm_nodes
    diffs = {
        "vs float64 reference": _rel_diff(mine, expected),
        "vs genlm sequential (float64)": _rel_diff(
            mine[:, ours_nodes], contenders["genlm sequential"]()[:, genlm_nodes]
        ),
        "genlm parallel (float32) vs reference": _rel_diff(
            contenders["genlm parallel"]()[:, genlm_nodes], expected[:, ours_nodes]
        ),
    }
    fastest_genlm = min(timings["genlm sequential"], timings["genlm parallel"])
    return {
        "ms": timings,
        "max_rel_diff": diffs,
        "speedup_vs_fastest_genlm": fastest_genlm / timings["lmqueue parallel"],
    }


def _log_space_max(tries: _Tries, lp: np.ndarray) -> tuple[float, int]:
    """Maxima of log-probabilities: our difference from the reference, genlm's wrong values."""
    mine = tries.ours.batch_weight_max(lp)
    clamped = tries.genlm_seq.batch_weight_max(lp)[:, tries.genlm_nodes]
    wrong = int((~np.isclose(clamped, mine[:, tries.ours_nodes])).sum())
    return _rel_diff(mine, _direct_masses(tries.ours.layout, lp, "max")), wrong


def _direct_masses(layout: TrieLayout, weights: np.ndarray, op: str) -> np.ndarray:
    """Float64 masses straight from each node's tokens (one run of the byte-sorted vocabulary).

    One ``reduceat`` over ``[lo, hi)`` boundaries of every node, sorted by ``lo``; the segments
    between two nodes' runs are computed and dropped.
    """
    ufunc = np.add if op == "sum" else np.maximum
    ordered = weights[:, layout.lex_order]
    ordered = np.concatenate([ordered, np.zeros((len(weights), 1))], axis=1)
    nodes = np.argsort(layout.lex_lo, kind="stable")
    bounds = np.stack([layout.lex_lo[nodes], layout.lex_hi[nodes]], axis=1).reshape(-1)
    out = np.empty((len(weights), layout.size))
    out[:, nodes] = ufunc.reduceat(ordered, bounds, axis=1)[:, ::2]
    return out


def _model_distributions(
    model: str, tokenizer: Any, batch: int, vocab_size: int, seed: int
) -> np.ndarray:
    """`batch` next-token distributions of `model` (float64), after prefixes of the bench text.

    One forward over the text yields the distribution after every prefix; `batch` of those
    positions are drawn with `seed` (with repeats only if the text is shorter than `batch`).
    Output rows past the tokenizer's vocabulary (a padded head) are dropped and the rest
    renormalized.
    """
    import torch

    from lmqueue.workers.models import load_causal_lm

    from .lib.workload import PROMPT_TEXT

    ids = list(tokenizer.encode(PROMPT_TEXT, add_special_tokens=False))
    positions = np.random.default_rng(seed).choice(len(ids), size=batch, replace=batch > len(ids))
    with torch.no_grad():
        logits = load_causal_lm(model)(torch.tensor([ids])).logits[0, np.sort(positions)]
    logits = logits[:, :vocab_size].to(torch.float64)
    return torch.softmax(logits, dim=-1).numpy()


def _time_round_robin(
    contenders: Mapping[str, Callable[[], Any]], repeats: int, warmup: int, torch: Any
) -> dict[str, float]:
    """Median ms per contender; genlm's torch trie gets its better thread setting."""
    default_threads = torch.get_num_threads()
    variants = dict(contenders)
    variants["genlm parallel, 1 thread"] = contenders["genlm parallel"]
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(warmup + repeats):
        for name, call in variants.items():
            torch.set_num_threads(1 if name.endswith("1 thread") else default_threads)
            started = time.perf_counter()
            call()
            if round_ >= warmup:
                samples[name].append((time.perf_counter() - started) * 1e3)
    torch.set_num_threads(default_threads)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    medians["genlm parallel"] = min(
        medians["genlm parallel"], medians.pop("genlm parallel, 1 thread")
    )
    return medians


def _matching_nodes(
    ours: ParallelTokenCharacterTrie, genlm: Any, genlm_vocab: list[Any]
) -> tuple[np.ndarray, np.ndarray]:
    """Node ids of the same prefixes and leaves in both tries, as two aligned arrays."""
    leaves = set(genlm.leaf2word)
    mine, theirs = [], []
    for node, prefix in genlm.node2prefix.items():
        if node not in leaves:
            mine.append(ours.node_of(bytes(prefix)))
            theirs.append(node)
    for position, token in enumerate(genlm_vocab):
        mine.append(ours.word2leaf[ours.tokens[position]])
        theirs.append(genlm.word2leaf[(bytes(token), token.token_id)])
    return np.array(mine), np.array(theirs)


def _rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    """Largest |got - want| / |want| (zero where both are zero)."""
    scale = np.where(want == 0, 1.0, np.abs(want))
    return float(np.max(np.abs(got - want) / scale))


def report(results: dict[str, Any]) -> str:
    """The results as text: configuration, raw timings, differences, and the ratios last."""
    lines = [f"config: {results['config']}"]
    for op in ("sum", "max"):
        lines.append(f"batch_weight_{op} (median ms):")
        lines += [f"  {name:<18} {ms:9.2f}" for name, ms in results[op]["ms"].items()]
        lines += [f"  max rel diff {k}: {v:.2e}" for k, v in results[op]["max_rel_diff"].items()]
    wrong = results["max"]["genlm_sequential_log_space_wrong"]
    lines.append(f"genlm sequential weight_max on log-probabilities: {wrong} node values wrong")
    for op in ("sum", "max"):
        ratio = results[op]["speedup_vs_fastest_genlm"]
        lines.append(
            f"batch_weight_{op}: lmqueue is {ratio:.2f}x faster than the faster genlm trie"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument("--batch", type=int, default=32, help="distributions per call")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--model", default="smollm2-135m", help="whose tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark, print its report; returns the result written to
    ``<out-dir>/trie.json``."""
    measured = measure(args.batch, args.repeats, args.warmup, args.model, args.seed)
    results = {"benchmark": "trie", **measured}
    print(report(results))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "trie.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"(wrote {path})")
    return results
