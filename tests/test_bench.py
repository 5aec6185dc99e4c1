"""The benchmark harness runs end to end in a tiny configuration, so it cannot rot unnoticed.

Only structure and sanity are checked (figures present, throughput positive, ratios computed),
never speed: timings on a shared test machine mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("psutil")

from lmqueue.bench import main as bench_main  # noqa: E402
from lmqueue.bench.lib.load import Window, distinct_prompt, percentile  # noqa: E402
from lmqueue.bench.lib.transport_scale import DEPLOYMENTS, _deployment_names  # noqa: E402


def _last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


def _result(out_dir: Path, name: str) -> dict[str, Any]:
    result = json.loads((out_dir / f"{name}.json").read_text())
    assert result["benchmark"] == name
    assert result["machine"]["nproc"] >= 1
    assert result["summary"]
    return result


def test_transport_benchmark_writes_figures_and_ends_with_its_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = "--dtypes float16 --concurrency 32 --warmup-s 0.3 --measure-s 1"
    argv = ["transport", *flags.split(), "--out-dir", str(tmp_path)]
    assert bench_main(argv) == 0
    result = _result(tmp_path, "transport")
    for config in ("probe", "defaults", "inline", "no_cache", "half_results"):
        window = result["figures"][f"float16.{config}"]
        assert window["replies"] > 0
        assert window["replies_per_s"] > 0
        assert set(window["cpu_us_per_reply"]) == {"client", "worker", "redis"}
        kernel = window["kernel_us_per_reply"]
        assert set(kernel) == {"client", "worker", "redis"}
        assert all(0 <= kernel[p] <= window["cpu_us_per_reply"][p] for p in kernel)
    over = result["figures"]["float16.defaults.over_probe_us"]
    defaults, probe = result["figures"]["float16.defaults"], result["figures"]["float16.probe"]
    for process in ("client", "worker", "redis"):
        wanted = defaults["kernel_us_per_reply"][process] - probe["kernel_us_per_reply"][process]
        assert over[process]["kernel"] == pytest.approx(wanted, abs=0.11)
        wanted = defaults["cpu_us_per_reply"][process] - probe["cpu_us_per_reply"][process]
        assert over[process]["cpu"] == pytest.approx(wanted, abs=0.11)
    assert result["figures"]["float16.inline.client_stats"]["claims_resolved"] == 0
    assert result["figures"]["batch_size"] == 32  # the workers' own default
    configs = ("float16.defaults", "float16.inline", "float16.no_cache", "float16.half_results")
    assert set(result["ratios"]) == {*configs, *(f"{c}.cpu" for c in configs)}
    assert all(ratio > 0 for ratio in result["ratios"].values())
    last = _last_line(capsys.readouterr().out)
    assert last == result["summary"]
    assert last.startswith("transport ratio lmqueue/raw-probe: float16")
    assert "(half results)" in last


def test_transport_compares_each_processs_float16_cpu_with_its_float32_cpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lmqueue.bench.lib.report import Report
    from lmqueue.bench.transport import _half_cpu_ratios

    report = Report("transport", {})
    assert _half_cpu_ratios(report) == {}  # one dtype only: nothing to compare
    for dtype, scale in (("float32", 2.0), ("float16", 1.0)):
        for config, worker in (("probe", 50.0), ("defaults", 120.0)):
            cpu = {"client": 100.0 * scale, "worker": worker * scale, "redis": 0.0}
            report.figure(f"{dtype}.{config}", {"cpu_us_per_reply": cpu})
    report.figures["float16.defaults"]["cpu_us_per_reply"]["worker"] = 180.0
    halves = _half_cpu_ratios(report)
    assert halves["probe"]["client"] == 0.5 and halves["probe"]["worker"] == 0.5
    assert halves["defaults"]["worker"] == 0.75  # 180 against 240
    assert math.isnan(halves["defaults"]["redis"])  # no float32 CPU to compare with
    assert report.figures["float16_over_float32_cpu"] == halves
    assert "defaults client 0.50, worker 0.75" in _last_line(capsys.readouterr().out)


def test_transport_scale_mode_meters_client_processes_and_each_workers_threads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = "--clients 2 --workers 2 --deployments single --dtypes float16 --concurrency 32"
    argv = ["transport", *flags.split(), "--warmup-s", "0.3", "--measure-s", "1"]
    assert bench_main([*argv, "--batch-size", "8", "--out-dir", str(tmp_path)]) == 0
    result = _result(tmp_path, "transport")
    assert result["figures"]["batch_size"] == 8
    for workers in (1, 2):
        window = result["figures"][f"float16.single.{workers}w"]
        assert len(window["clients"]) == 2 and window["replies_per_s"] > 0
        assert all(c["replies"] > 0 and c["threads_cpu_s"]["other"] > 0 for c in window["clients"])
        assert len(window["worker_threads"]) == workers
        assert all(t["main"] > 0 for t in window["worker_threads"].values())
        assert result["ratios"][f"float16.single.{workers}w.worker_us"] > 0
        assert window["redis_rss_mib"] > 0  # what the cache's TTL bounds
    last = _last_line(capsys.readouterr().out)
    assert "transport scale" in last
    assert last.endswith("(workers' batch size 8, not the default 32)")


def test_transport_batch_size_flag_reaches_the_workers_settings() -> None:
    from lmqueue.bench.lib.stack import batch_size_env
    from lmqueue.bench.transport import add_arguments
    from lmqueue.shared.settings import DEFAULT_BATCH_SIZE, WorkerSettings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).batch_size == DEFAULT_BATCH_SIZE
    rows = parser.parse_args(["--batch-size", "64"]).batch_size
    assert WorkerSettings.from_env(batch_size_env(rows), model="m").batch_size == 64
    for bad in ("0", "-3"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--batch-size", bad])


def test_transport_scale_mode_runs_the_deployments_named_and_refuses_others(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _deployment_names("single") == ["single"]
    assert _deployment_names("cluster, single") == ["cluster", "single"]
    assert _deployment_names("both") == _deployment_names("single,cluster") == list(DEPLOYMENTS)
    with pytest.raises(SystemExit):  # "both" once ran as a cluster named "both"; a typo too
        bench_main(["transport", "--clients", "1", "--workers", "1", "--deployments", "singel"])
    assert "'singel': expected single, cluster" in capsys.readouterr().err


@pytest.mark.cluster
def test_cluster_benchmark_compares_one_instance_with_a_cluster_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = "--dtypes float16 --concurrency 32 --warmup-s 0.3 --measure-s 1"
    assert bench_main(["cluster", *flags.split(), "--out-dir", str(tmp_path)]) == 0
    result = _result(tmp_path, "cluster")
    single, cluster = result["figures"]["float16.single"], result["figures"]["float16.cluster"]
    assert single["replies"] > 0 and cluster["replies"] > 0
    assert set(single["cpu_us_per_reply"]) == {"client", "worker", "redis"}
    assert set(cluster["cpu_us_per_reply"]) == {"client", "worker", "redis", "replicas"}
    assert set(result["ratios"]) == {"float16.replies", "float16.cpu"}
    assert all(ratio > 0 for ratio in result["ratios"].values())
    assert _last_line(capsys.readouterr().out).startswith("cluster (3 masters) / single instance")


def test_cache_benchmark_answers_every_timed_call_from_the_shared_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = "--dtypes float32 --calls 200 --prompts 16"
    argv = ["cache", *flags.split(), "--out-dir", str(tmp_path)]
    assert bench_main(argv) == 0
    result = _result(tmp_path, "cache")
    figures = result["figures"]["float32"]
    assert figures["calls"] == 200
    assert figures["shared_cache_hits"] == 200
    assert figures["sent_to_workers"] == 0
    assert 0 < figures["p50_ms"] <= figures["p99_ms"]
    assert figures["raw_get_p50_ms"] > 0
    assert result["ratios"]["float32.p50_over_target"] > 0
    assert _last_line(capsys.readouterr().out).startswith("cache hit latency: float32 p50")


def test_an_unknown_benchmark_name_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["no-such-benchmark"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_throughput_is_the_slope_of_completions_so_batch_bursts_do_not_skew_it() -> None:
    # 32 replies every 0.4 s, a 5 s window opening mid-cycle: counting gives 83.2/s.
    times = [0.15 + 0.4 * k for k in range(13) for _ in range(32)]
    window = Window(len(times), 5.0, {}, times)
    assert window.per_s == pytest.approx(83.2)
    assert window.fitted_per_s == pytest.approx(80.0)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0


def test_distinct_prompts_never_repeat_within_a_run() -> None:
    prompts = {tuple(distinct_prompt(i, salt=5)) for i in range(100_000)}
    assert len(prompts) == 100_000
    assert max(max(p) for p in prompts) <= 32_768


@pytest.mark.slow
def test_programs_benchmark_runs_both_sides_in_separate_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("genlm.backend")
    flags = "--programs 1 --steps 2 --particles 2"
    assert bench_main(["programs", *flags.split(), "--out-dir", str(tmp_path)]) == 0
    result = _result(tmp_path, "programs")
    for side in ("genlm", "lmqueue"):
        figures = result["figures"][f"k1.{side}"]
        assert figures["calls"] > 0 and figures["calls_per_s"] > 0
        assert figures["peak_rss_bytes"] > 100 * 2**20  # a model (or a worker's) is in it
        assert len(figures["per_program"]) == 1
    assert set(result["ratios"]) == {"k1_calls_per_s", "k1_memory"}
    assert _last_line(capsys.readouterr().out).startswith(
        "programs ratio lmqueue/genlm (genlm at its best grid point): K=1"
    )


def test_fairness_benchmark_reports_every_run_its_tail_and_the_worst_beside_the_median(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = (
        "--warmup-s 0.3 --measure-s 1.5 --flood-inflight 200 --weighted-inflight 50 "
        "--light-inflight 8 --repeats 2 --docs-plot="
    )
    trace = tmp_path / "trace"
    argv = ["fairness", *flags.split(), "--out-dir", str(tmp_path), "--trace-dir", str(trace)]
    assert bench_main(argv) == 0
    result = _result(tmp_path, "fairness")
    for run in ("run1", "run2"):
        (worker,) = trace.joinpath(run).glob("worker-*.txt")  # B's round trip, stage by stage
        round_trip = result["figures"][f"{run}.round_trip.{worker.stem}"]
        assert round_trip["forward_start"]["n"] > 0
        assert 0 < round_trip["written"]["p50"] < round_trip["forward_start"]["p50"]
        assert round_trip["client.replies"]["n"] > 0 and round_trip["read"]["n"] > 0
        for scheme in ("fair_share", "fifo"):
            figures = result["figures"][f"{run}.{scheme}"]
            alone, under = figures["light_alone"], figures["light_under_flood"]
            assert alone["calls"] > 0 and under["calls"] > 0
            assert alone["p50_s"] <= alone["p99_s"] <= alone["p999_s"] <= alone["max_s"]
            assert sum(under["histogram_ms"]["counts"]) == under["calls"]
            assert len(figures["light_under_flood_ms"]) == under["calls"]
            assert figures["tokens_per_s_flood_alone"] > 0
        assert result["figures"][f"{run}.weights"]["tokens_weight_2"] > 0
    runs = result["figures"]["spread"]["runs"]
    p99s = [run["p99_ratio"] for run in runs]
    assert len(runs) == 2 and all(run["load_avg"] for run in runs)
    assert result["ratios"]["p99_under_flood_over_alone"] == max(p99s)
    assert result["ratios"]["throughput_under_flood_over_alone"] == min(
        run["throughput_ratio"] for run in runs
    )
    assert (tmp_path / "fairness.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "B under flood:" in out and "p99.9" in out and "run 2:" in out
    assert _last_line(out).startswith("fairness (2 run(s), worst / median): B's p99 under flood")


def test_affinity_benchmark_counts_the_prompt_tokens_each_configuration_computed(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = "--programs 2 --particles 3 --steps 2 --prompt-tokens 20 --partitions 4 --docs-plot="
    argv = ["affinity", "--model", str(tiny_model_dir), *flags.split(), "--out-dir", str(tmp_path)]
    assert bench_main(argv) == 0
    result = _result(tmp_path, "affinity")
    for name, workers in (("single", 1), ("off", 2), ("on", 2)):
        figures = result["figures"][name]
        assert len(figures["per_worker"]) == figures["workers"] == workers
        assert figures["calls"] >= 2 * 3  # every program's first step, at least
        # each program's prompt was computed once at least, and nothing more than every call's
        # whole prompt (20 tokens + at most 2 generated)
        assert 2 * 20 <= figures["computed_tokens"] <= figures["calls"] * 22
        assert sum(w["requests"] for w in figures["per_worker"]) > 0
        assert figures["computed_per_call"] == pytest.approx(
            figures["computed_tokens"] / figures["calls"], abs=1e-3
        )
    assert result["figures"]["on"]["partitions"] == 4
    assert set(result["ratios"]) == {"on_tokens", "off_tokens", "on_calls_per_s", "off_calls_per_s"}
    assert all(ratio > 0 for ratio in result["ratios"].values())
    assert _last_line(capsys.readouterr().out).startswith("affinity ratio 2 workers/1 worker")


def test_the_anchor_grid_holds_its_defaults_the_particle_count_and_lmqueues_settings() -> None:
    pytest.importorskip("genlm.backend")
    from lmqueue.bench.lib.anchor_grid import best, grid

    points = grid(16)
    assert [(p.batch_size, p.timeout_s) for p in points] == [
        (20, 0.02), (20, 0.005), (16, 0.02), (16, 0.005), (32, 0.02), (32, 0.005),
    ]  # fmt: skip
    assert len(grid(20)) == 4  # the particle count is the default: each point once
    assert grid(16, "defaults") == points[:1]
    per_s = {p.label: float(i) for i, p in enumerate(points)}
    per_s[points[2].label] = 99.0
    assert best(per_s, points) == points[2]


def test_a_tail_shows_in_the_histogram_and_the_worst_run_is_the_figure() -> None:
    from lmqueue.bench.lib.tails import latency_figures, spread

    values = [0.08] * 990 + [0.45] * 10  # one held forward's calls
    figures = latency_figures(values)
    assert figures["p50_s"] == 0.08 and figures["p999_s"] == 0.45
    edges, counts = figures["histogram_ms"]["edges"], figures["histogram_ms"]["counts"]
    assert len(counts) == len(edges) + 1 and sum(counts) == 1000
    assert counts[edges.index(100)] == 990 and counts[edges.index(500)] == 10
    runs = [{"p99": 1.8, "tput": 0.97}, {"p99": 2.4, "tput": 0.95}, {"p99": 1.9, "tput": 0.99}]
    summary = spread(runs, {"p99": True, "tput": False})
    assert summary["p99"]["worst"] == 2.4 and summary["p99"]["median"] == 1.9
    assert summary["tput"]["worst"] == 0.95


def test_without_resp_pipe_the_clients_take_redis_pys_path() -> None:
    from lmqueue.bench.transport import _without_resp_pipe
    from lmqueue.producer.resp_pipe import RespPipe

    assert RespPipe.supports("redis://127.0.0.1:6379")
    with _without_resp_pipe():
        assert not RespPipe.supports("redis://127.0.0.1:6379")
    assert RespPipe.supports("redis://127.0.0.1:6379")


def test_forward_benchmark_counts_the_same_operations_whatever_the_rows_and_segments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = "--rows 2,6 --segments 1,4 --layers 2 --hidden 32 --repeats 1 --device cpu"
    assert bench_main(["forward", *flags.split(), "--out-dir", str(tmp_path)]) == 0
    result = _result(tmp_path, "forward")
    ops = [result["figures"][f"{r}x{s}"]["ops"] for r in (2, 6) for s in (1, 4)]
    assert min(ops) > 50  # a forward's operations were counted on its thread
    assert max(ops) - min(ops) <= 1  # a staging tensor that grows is one allocation more
    assert _last_line(capsys.readouterr().out).startswith("forward: ops per forward")
