"""decode_vocab and Token: exact bytes for byte-level BPE and SentencePiece tokenizers."""

from __future__ import annotations

import pytest

from lmqueue.shared.lm.tokens import Token
from lmqueue.shared.lm.vocab import VocabularyError, decode_vocab

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines\r\n",
    "’•¶∂ƒ˙∆£Ħ爨ൠᅘ∰፨ emoji 🐈‍⬛ and accents: déjà vu, naïve",
    "<|im_start|>user\nspecial tokens<|im_end|>",
    "code: def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module")
def smol_vocab(smol_tokenizer):
    return decode_vocab(smol_tokenizer)


def test_every_smollm2_token_has_bytes_and_its_own_id(smol_tokenizer, smol_vocab):
    byte_vocab, str_vocab = smol_vocab
    assert len(byte_vocab) == len(str_vocab) == len(smol_tokenizer) == 49152
    assert all(token.token_id == i for i, token in enumerate(byte_vocab))


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_encoded_text(smol_tokenizer, smol_vocab, text):
    byte_vocab, _ = smol_vocab
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(byte_vocab[i] for i in ids) == text.encode("utf-8")


def test_every_smollm2_token_round_trips_through_the_tokenizer(smol_tokenizer, smol_vocab):
    """Each token's bytes, when they are whole UTF-8, are what the tokenizer decodes it to."""
    byte_vocab, str_vocab = smol_vocab
    checked = 0
    for token in byte_vocab:
        try:
            text = bytes(token).decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert smol_tokenizer.decode([token.token_id]) == text
        assert str_vocab[token.token_id] == text
        checked += 1
    assert checked > 48_000


def test_partial_utf8_tokens_get_the_tokenizers_spelling(smol_tokenizer, smol_vocab):
    byte_vocab, str_vocab = smol_vocab
    partial = [t for t in byte_vocab if not _is_utf8(bytes(t))]
    assert partial, "SmolLM2 has byte tokens that are not whole characters"
    for token in partial[:50]:
        assert str_vocab[token.token_id] == smol_tokenizer.convert_ids_to_tokens(token.token_id)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _sentencepiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    merges = [("▁", "h"), ("▁h", "i"), ("▁", "y"), ("▁y", "o"), ("▁yo", "u")]
    for piece in ["▁", "h", "i", "y", "o", "u", "▁h", "▁hi", "▁y", "▁yo", "▁you"]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_sentencepiece_spaces_and_byte_fallbacks_decode_to_bytes():
    tokenizer = _sentencepiece_tokenizer()
    byte_vocab, str_vocab = decode_vocab(tokenizer)
    text = "hi you é!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert "<0xC3>" in pieces and "▁you" in pieces
    assert b"".join(byte_vocab[i] for i in ids) == b" " + text.encode("utf-8")
    assert byte_vocab[tokenizer.convert_tokens_to_ids("<0xC3>")] == b"\xc3"
    assert str_vocab[tokenizer.convert_tokens_to_ids("▁you")] == " you"


def test_an_unknown_decoder_is_refused():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece()
    with pytest.raises(VocabularyError, match="WordPiece"):
        decode_vocab(PreTrainedTokenizerFast(tokenizer_object=tokenizer))


def test_tokens_are_bytes_that_compare_by_id():
    a, b = Token(1, b"x"), Token(2, b"x")
    assert a != b and a == Token(1, b"other") and a == b"x"
    assert b"".join([a, b]) == b"xx" and a.byte_string == b"x"
    assert len({a, b, Token(1, b"x")}) == 2
    assert sorted([b, a]) == [a, b]
    with pytest.raises(TypeError):
        Token("1", b"x")  # type: ignore[arg-type]


def test_tokenizers_load_from_published_files_in_many_threads_at_once(tmp_path):
    """Concurrent connects load the tokenizer together: no import race, no torn directory."""
    import subprocess
    import sys

    code = (
        "import concurrent.futures as cf, sys\n"
        "from pathlib import Path\n"
        "from shared.registry import tokenizer_from_files\n"
        "import msgpack\n"
        "files = msgpack.unpackb(Path(sys.argv[1]).read_bytes())\n"
        "with cf.ThreadPoolExecutor(8) as pool:\n"
        "    toks = list(pool.map(lambda _: tokenizer_from_files(files, Path(sys.argv[2])), "
        "range(8)))\n"
        "print(len({len(t) for t in toks}), len(toks[0]))\n"
    )
    import msgpack

    from lmqueue.shared.registry import tokenizer_to_files
    from lmqueue.workers.models import load_tokenizer

    files = tokenizer_to_files(load_tokenizer("smollm2-135m"))
    blob = tmp_path / "files.msgpack"
    blob.write_bytes(msgpack.packb(files, use_bin_type=True))
    # a fresh interpreter: transformers not yet imported, as in a new client process
    done = subprocess.run(
        [sys.executable, "-c", code, str(blob), str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "49152"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] != []
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


def test_the_light_tokenizer_answers_as_the_huggingface_one(tmp_path, smol_tokenizer):
    """Same ids, texts, special tokens and vocabulary as transformers' tokenizer of the files."""
    from lmqueue.shared.lm.light_tokenizer import LightTokenizer

    smol_tokenizer.save_pretrained(tmp_path)
    light = LightTokenizer(tmp_path)
    texts = ["Hello, my name is", " a cat", "<|im_start|>user\nhé ☃ 日本<|im_end|>", ""]
    for text in texts:
        for special in (True, False):
            ids = smol_tokenizer.encode(text, add_special_tokens=special)
            assert light.encode(text, add_special_tokens=special) == ids
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == smol_tokenizer.decode(
                ids, skip_special_tokens=skip
            )
    for name in ("bos", "eos", "pad", "unk"):
        assert getattr(light, f"{name}_token_id") == getattr(smol_tokenizer, f"{name}_token_id")
    assert len(light) == len(smol_tokenizer) and light.get_vocab() == smol_tokenizer.get_vocab()
    assert decode_vocab(light) == decode_vocab(smol_tokenizer)
    chat = [{"role": "user", "content": "hi"}]  # not its own: answered by the full tokenizer
    assert light.apply_chat_template(chat, tokenize=False) == smol_tokenizer.apply_chat_template(
        chat, tokenize=False
    )
