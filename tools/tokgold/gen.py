#!/usr/bin/env python3
"""Gold token ids for pulsar-tokenizer, from Hugging Face's reference tokenizers.

Writes, under host/tokenizer/tests/fixtures/:
  gemma3_gold.json  ids HF's tokenizer gives for the corpus, the tokenizer built from the real
                    gemma-3-270m GGUF (the Rust test reads the vocabulary from that same file);
  bpe_vocab.json    a small byte-level BPE vocabulary (tokens, types, merges) trained here with
                    the `tokenizers` library, shaped like a GGUF's `gpt2` tokenizer metadata;
  bpe_gold.json     ids HF `tokenizers` gives for the corpus with that vocabulary, once per
                    pre-tokenizer type (`tokenizer.ggml.pre`), configured as pre_configs() says.

Usage: python tools/tokgold/gen.py [--gguf PATH] [--dump-gemma-vocab PATH]
  --dump-gemma-vocab writes the GGUF's tokenizer arrays as JSON (a development aid; not a fixture).
Versions are pinned in requirements.txt beside this file.
"""

import argparse
import hashlib
import json
import os
import sys
import types
from pathlib import Path

import transformers  # imported before anything below touches sys.modules
import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "host" / "tokenizer" / "tests" / "fixtures"
DEFAULT_GGUF = os.environ.get(
    "PULSAR_GEMMA_GGUF", str(Path.home() / ".cache" / "pulsar" / "models" / "gemma-3-270m-Q4_K_M.gguf")
)

# A varied corpus: every text is encoded by every reference below.
CORPUS = [
    "",
    "Hello world",
    "Hello, World! How's it going?",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "   ",
    " ",
    "\n",
    "\n\n\n",
    "\t",
    "a\tb\t\tc",
    "line one\nline two\r\nline three\n\nend",
    "   \n  \n\t\n",
    "mixed \t \n whitespace",
    "a" + " " * 40 + "b",
    "naïve café résumé, Ünïcödé",
    "Ελληνικά γράμματα και Русский текст",
    "日本語のテキストを分割します。",
    "中文分词测试，包括标点符号！",
    "한국어 문장입니다",
    "العربية لغة جميلة",
    "हिन्दी भाषा",
    "ภาษาไทย",
    "emoji: 😀😃🎉 👍🏽",
    "family 👨‍👩‍👧‍👦 and astronaut 🧑🏽‍🚀 flag 🇯🇵",
    "new emoji 🫨 and 🪿 geese",
    "combining e\u0301 and n\u0303 marks",
    "no\u00a0break\u2009thin\u3000ideographic",
    "zero\u200bwidth\u200djoiner",
    "control \x00\x01\x1f\x7f chars",
    "rare 𒀀 ꙮ \ue000 \U0010fffd",
    "it's don't I'M we'LL you'Re they've he'd it'ſ",
    "12345",
    "3.14159 and 2,718",
    "1234567890123456789012345",
    "phone: +1 (555) 010-9999",
    "١٢٣٤ ½ Ⅻ ²³",
    "fn main() {\n    println!(\"hi {}\", x);\n}\n",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n\treturn -x\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<div class=\"c\">hi</div><span>x</span>",
    "x += 1;  // comment\ny -= 2;",
    "$$\\frac{a}{b}$$ ~~ ^^ || <=> ++",
    "supercalifragilisticexpialidocious",
    "a" * 300,
    "ab" * 150,
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos<eos>",
    "<start_of_turn",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "<<|im_end|>> and <|endoftext|><|endoftext|>",
    "<think>let me think</think>answer",
    "<|im_start",
    "<0x0A> is not a newline",
    "▁ is a lower one eighth block",
    "Ġ and Ċ are byte-level letters",
    " xyzzy",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
]

# GGUF `tokenizer.ggml.pre` -> how the reference is configured.
# - llama-bpe, qwen2, qwen35, gpt-4o: the split regex transformers itself applies when it loads a
#   GGUF with that `pre` (GGUF_PRE_TOKENIZER_SPLITS), which is the regex of the models' own
#   tokenizer.json; llama-bpe also sets `ignore_merges`, as llama3's tokenizer.json and llama.cpp do.
# - deepseek-v3: the three Splits of DeepSeek-V3's tokenizer.json (transformers has no entry).
# - default: llama.cpp's fallback regex list (llama-vocab.cpp); there is no tokenizer.json for it.
# - gpt-2: tokenizers' built-in ByteLevel regex, exactly what GPT-2's tokenizer runs.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
DEEPSEEK_V3_SPLITS = [
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]


# - kimi-k2: the tiktoken pat_str of Kimi K2's tokenization_kimi.py (one regex; tiktoken's
#   findall and an isolated Split cut the same pieces, since its alternatives cover every char).
KIMI_K2_SPLIT = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def pre_configs():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS as HF

    return {
        "default": {
            "splits": [r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"],
            "ignore_merges": False,
        },
        "gpt-2": {"splits": None, "ignore_merges": False},
        "llama-bpe": {"splits": [HF["llama-bpe"]], "ignore_merges": True},
        "qwen2": {"splits": [HF["qwen2"]], "ignore_merges": False},
        "qwen35": {"splits": [HF["qwen35"]], "ignore_merges": False},
        "gpt-4o": {"splits": [HF["gpt-4o"]], "ignore_merges": False},
        "deepseek-v3": {"splits": DEEPSEEK_V3_SPLITS, "ignore_merges": False},
        "kimi-k2": {"splits": [KIMI_K2_SPLIT], "ignore_merges": False},
        # MiniMax M2 / M3: transformers' own table has its tokenizer.json regex.
        "minimax-m2": {"splits": [HF["minimax-m2"]], "ignore_merges": False},
        # Hy3 (hy_v3 GGUFs say `hy_v4`): llama.cpp runs DeepSeek-V3's three splits for it;
        # transformers' table has no entry.
        "hy_v4": {"splits": DEEPSEEK_V3_SPLITS, "ignore_merges": False},
    }


BPE_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_USER_DEFINED = ["<think>", "</think>"]
# A normal token no merge can build: only a tokenizer that looks whole words up before merging
# (llama3's `ignore_merges`) emits it for " xyzzy".
BPE_UNREACHABLE = "Ġxyzzy"
BPE_VOCAB_SIZE = 3000


def versions():
    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def write_json(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    path.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(REPO)} ({len(text)} bytes)", file=sys.stderr)


# ---------------------------------------------------------------- gemma3 (SentencePiece in a GGUF)


def gemma_reference(gguf_path):
    """HF's tokenizer for this GGUF, built by transformers' own GGUF tokenizer path.

    `AutoTokenizer.from_pretrained(dir, gguf_file=name)` resolves gemma3 to `GemmaTokenizer`
    and then runs `GemmaTokenizer.from_pretrained(dir, gguf_file=name)`; that call is made
    here directly, because AutoTokenizer first builds the model config through a loader that
    requires torch, which this environment does not have. The GGUF metadata reader that the
    tokenizer path uses (`transformers.integrations.gguf.reader`) imports torch only for tensor
    dtype constants; it is imported once with a placeholder `torch` module in place, and the
    placeholder is removed before any tokenizer code runs.
    """
    placeholder = types.ModuleType("torch")

    class _Inert:
        def __getattr__(self, _name):
            return _Inert()

        def __call__(self, *_a, **_k):
            return _Inert()

        def __or__(self, _other):
            return _Inert()

        __ror__ = __or__

    placeholder.__getattr__ = lambda _name: _Inert()
    sys.modules["torch"] = placeholder
    try:
        import transformers.integrations.gguf.reader  # noqa: F401
    finally:
        del sys.modules["torch"]
    from transformers import GemmaTokenizer

    path = Path(gguf_path)
    return GemmaTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gen_gemma(gguf_path):
    tok = gemma_reference(gguf_path)
    backend = tok.backend_tokenizer
    cases = []
    for text in CORPUS:
        ids = backend.encode(text, add_special_tokens=False).ids
        with_special = tok.encode(text, add_special_tokens=True)
        backend.encode_special_tokens = True  # control tokens stay text; user-defined still split
        plain = backend.encode(text, add_special_tokens=False).ids
        backend.encode_special_tokens = False
        cases.append(
            {
                "text": text,
                "ids": ids,
                "ids_add_special": with_special,
                "ids_no_parse_special": plain,
                "decoded": backend.decode(ids, skip_special_tokens=False),
            }
        )
    write_json(
        FIXTURES / "gemma3_gold.json",
        {
            "reference": "transformers GemmaTokenizer.from_pretrained(dir, gguf_file=...) on the GGUF below",
            "versions": versions(),
            "gguf": Path(gguf_path).name,
            "gguf_sha256": sha256_of(gguf_path),
            "cases": cases,
        },
    )


def dump_gemma_vocab(gguf_path, out):
    import gguf

    reader = gguf.GGUFReader(gguf_path)

    def get(key):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    write = {
        "model": get("tokenizer.ggml.model"),
        "pre": get("tokenizer.ggml.pre"),
        "architecture": get("general.architecture"),
        "tokens": get("tokenizer.ggml.tokens"),
        "scores": get("tokenizer.ggml.scores"),
        "token_types": get("tokenizer.ggml.token_type"),
        "bos": get("tokenizer.ggml.bos_token_id"),
        "eos": get("tokenizer.ggml.eos_token_id"),
        "unk": get("tokenizer.ggml.unknown_token_id"),
        "pad": get("tokenizer.ggml.padding_token_id"),
        "add_bos": get("tokenizer.ggml.add_bos_token"),
        "add_eos": get("tokenizer.ggml.add_eos_token"),
        "add_space_prefix": get("tokenizer.ggml.add_space_prefix"),
    }
    Path(out).write_text(json.dumps(write, ensure_ascii=False), encoding="utf-8")
    print(f"wrote {out}", file=sys.stderr)


# ---------------------------------------------------------------- byte-level BPE (a GGUF `gpt2`)


def training_text():
    """English prose and code from the pinned transformers sources, plus the corpus and a few
    lines in other scripts, so the vocabulary has merges across all of them."""
    root = Path(transformers.__file__).parent
    sources = ["tokenization_utils_base.py", "convert_slow_tokenizer.py", "models/gemma/tokenization_gemma.py"]
    texts = [(root / s).read_text(encoding="utf-8") for s in sources]
    texts += [t for t in CORPUS if "xyzzy" not in t] * 20
    texts += [
        "Ελληνικά γράμματα. Русский язык, русские слова и предложения. Українська мова.",
        "日本語の文章です。これはテストです。東京と京都。中文句子，这是一个测试。北京和上海。",
        "한국어 문장입니다. 서울과 부산. العربية لغة جميلة ومكتوبة من اليمين. हिन्दी भाषा का वाक्य।",
    ] * 40
    return texts


def train_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=BPE_CONTROL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for text, index in vocab.items():
        tokens[index] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types_ = [3 if t in BPE_CONTROL else 1 for t in tokens]
    for extra, kind in [(t, 4) for t in BPE_USER_DEFINED] + [(BPE_UNREACHABLE, 1)]:
        assert extra not in vocab, f"{extra!r} was learned by the trainer; pick another"
        tokens.append(extra)
        types_.append(kind)
    return {
        "model": "gpt2",
        "tokens": tokens,
        "token_types": types_,
        "merges": merges,
        "eos": tokens.index("<|endoftext|>"),
        "eot": tokens.index("<|im_end|>"),
    }


def bpe_reference(vocab_fixture, config):
    vocab = {t: i for i, t in enumerate(vocab_fixture["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in vocab_fixture["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=config["ignore_merges"]))
    if config["splits"] is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in config["splits"]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    kinds = vocab_fixture["token_types"]
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(vocab_fixture["tokens"], kinds) if k == 3]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(vocab_fixture["tokens"], kinds) if k == 4]
    )
    return tok


def gen_bpe():
    fixture = train_bpe()
    write_json(FIXTURES / "bpe_vocab.json", fixture)
    gold = {}
    for pre, config in pre_configs().items():
        tok = bpe_reference(fixture, config)
        ids = [tok.encode(text, add_special_tokens=False).ids for text in CORPUS]
        tok.encode_special_tokens = True
        plain = [tok.encode(text, add_special_tokens=False).ids for text in CORPUS]
        gold[pre] = {"ids": ids, "ids_no_parse_special": plain}
    write_json(
        FIXTURES / "bpe_gold.json",
        {
            "reference": "tokenizers BPE + Split(regex, isolated) per pre type + ByteLevel(use_regex=False); "
            "gpt-2 uses ByteLevel(use_regex=True); see tools/tokgold/gen.py",
            "versions": versions(),
            "texts": CORPUS,
            "pre": gold,
        },
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=DEFAULT_GGUF, help="gemma-3-270m GGUF (default: %(default)s)")
    parser.add_argument("--dump-gemma-vocab", metavar="PATH", help="also write the GGUF's tokenizer arrays here")
    args = parser.parse_args()
    if not Path(args.gguf).is_file():
        sys.exit(f"{args.gguf} not found: run scripts/fetch-gemma.sh first")
    gen_gemma(args.gguf)
    if args.dump_gemma_vocab:
        dump_gemma_vocab(args.gguf, args.dump_gemma_vocab)
    gen_bpe()


if __name__ == "__main__":
    main()
