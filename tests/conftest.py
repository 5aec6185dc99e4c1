"""Fixtures shared by the whole suite: a real redis-server, real tokenizers, tiny real models."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from lmqueue.devstack import LocalCluster, LocalRedis, free_port

SMOL = "smollm2-135m"
ENGINE_CLASSES = Path(__file__).resolve().parent.parent / ".engine-classes"


def pytest_configure(config: pytest.Config) -> None:
    """Make SGLang's classes importable for its adapter tests, if `make test-engines` unpacked
    them (scripts/engine_env.sh).

    Appended, so every package of the real environment (torch above all) still wins.
    """
    if ENGINE_CLASSES.is_dir() and str(ENGINE_CLASSES) not in sys.path:
        sys.path.append(str(ENGINE_CLASSES))


@pytest.fixture
def interpreter_gc_thresholds() -> Iterator[None]:
    """The collector's thresholds at the interpreter's default (700, 10, 10) for the test; the
    suite process's own (a client connected in it raises them) come back after."""
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """One redis-server for the test session, on a free loopback port."""
    server = LocalRedis().start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    """The session server's URL, flushed before the test (restarted if a test killed it)."""
    if redis_server.process is None or redis_server.process.poll() is not None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """One Redis Cluster for the test session (3 masters, a replica each), started on first use."""
    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture
def cluster_url(redis_cluster: LocalCluster) -> str:
    """The URL of one node of the session cluster, every master flushed before the test."""
    redis_cluster.flush()
    return redis_cluster.url


@pytest.fixture(params=["single", pytest.param("cluster", marks=pytest.mark.cluster)])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """A flushed single instance, then a flushed cluster: the test runs against both."""
    return str(request.getfixturevalue("redis_url" if request.param == "single" else "cluster_url"))


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client of the flushed session server."""
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def smol_tokenizer() -> Any:
    """The real SmolLM2 tokenizer (49,152 tokens, byte-level BPE)."""
    from lmqueue.workers.models import load_tokenizer

    return load_tokenizer(SMOL)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smol_tokenizer: Any) -> Path:
    """A tiny random Llama over the SmolLM2 tokenizer, saved as a HuggingFace model directory.

    Same vocabulary and architecture family as SmolLM2, two layers of width 64: real forward
    passes, real KV caches, in milliseconds.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smol_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=smol_tokenizer.bos_token_id,
        eos_token_id=smol_tokenizer.eos_token_id,
        pad_token_id=smol_tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A redis-server speaking only TLS, with a certificate made by openssl now.

    Yields the ``rediss://`` URL of its (all-permissions) default user, which verifies the
    server against the certificate, and the certificate's path.
    """
    cert, key = _certificate(tmp_path_factory.mktemp("tls"))
    port = free_port()
    args = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
            "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
            "--tls-auth-clients", "no"]  # fmt: skip
    server = LocalRedis(args=args)
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}&ssl_check_hostname=true"
    server.start(ready=lambda: _answers_over_tls(url))
    yield url, cert
    server.close()


@pytest.fixture(scope="session")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A Redis Cluster speaking only TLS (3 masters, no replicas), its own certificate."""
    with LocalCluster(replicas=0, tls=_certificate(tmp_path_factory.mktemp("tls-c"))) as cluster:
        yield cluster


def _certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 made by openssl now, and its key."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _answers_over_tls(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False
    finally:
        client.close()
