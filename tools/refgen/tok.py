"""Tiny tokenizers for the parity fixtures.

Two kinds, because llama.cpp's converter reads two kinds:
- byte-level BPE with merges (tokenizer.json, `tokenizers` library) for the
  GPT-2 style families; the converter writes tokenizer.ggml.model = "gpt2";
- a SentencePiece BPE model (tokenizer.model) for the Gemma families, whose
  real files are SPM ("llama" tokenizer model in GGUF terms).

Both are trained on CORPUS below, single-threaded, so they come out the same on
every run (checked by gen.py, which compares a digest of the vocab).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Fixed training text. Its content only matters in that it is fixed and that
# the merges it yields make the prompt below split into many different tokens.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model reads a long file.
Mixture of experts routes every token to a few experts out of many; the router
scores each expert and keeps the top k. Attention looks back over the cache,
sliding windows keep only the recent past, and full layers see everything.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 128 256 1024 3.14159 2.71828.
Code: def forward(x): return x @ w + b  # comment
for i in range(10): print(i, i * i)
Questions? Answers! Lists, commas; colons: quotes "like this" and 'that'.
Rivers run to the sea, the sea feeds the clouds, clouds rain on the hills.
Every layer normalises its input, projects it, mixes it and adds it back.
The engine streams experts from disk and keeps the hot ones in memory.
Hello world. Hello again, world. Goodbye for now, and thanks for all the fish.
"""

# The fixed prompt whose logits are saved. Long enough (with the small vocab)
# to give ~30-40 tokens, so that sliding windows of 8 are really exercised.
PROMPT = "The router keeps the top k experts; sliding windows see the recent past. 42!"

# The split regex of Qwen2's tokenizer.json (llama.cpp pre-type "qwen2"). All
# BPE fixtures use it; tokenizer.ggml.pre is still set to each family's real
# value (see convert_wrapper.py), so token ids, not re-tokenisation, are the
# contract of a fixture.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _corpus_lines() -> list[str]:
    # Repeat the corpus so the trainer's pair counts are well above 1.
    return CORPUS.splitlines() * 4


def build_bpe(out_dir: Path, vocab_size: int, specials: list[str], *, bos: str | None, eos: str,
              add_bos: bool, chat_template: str | None = None) -> dict:
    """Train a byte-level BPE whose total size (incl. specials) is vocab_size.

    Writes tokenizer.json + tokenizer_config.json into out_dir and returns
    {"ids": prompt ids (BOS first when add_bos), "bos_id", "eos_id"}.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    n_regular = tok.get_vocab_size()
    if n_regular != vocab_size - len(specials):
        raise RuntimeError(f"BPE trainer gave {n_regular} tokens, wanted {vocab_size - len(specials)}: "
                           "enlarge CORPUS or lower vocab_size")
    # Specials go at the end, after the regular tokens, like Qwen/DeepSeek.
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size() == vocab_size

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    vocab = tok.get_vocab()
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "eos_token": eos,
        "bos_token": bos,
        "pad_token": eos,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(vocab[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True}
            for s in specials
        },
    }
    if chat_template:
        cfg["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    ids = tok.encode(PROMPT).ids
    bos_id = vocab[bos] if bos else None
    if add_bos:
        ids = [bos_id] + ids
    return {"ids": ids, "bos_id": bos_id, "eos_id": vocab[eos], "kind": "bpe",
            "special_ids": {s: vocab[s] for s in specials}}


# Gemma's special-token layout at the start of its SPM vocab.
GEMMA_SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}


def build_spm(out_dir: Path, vocab_size: int, user_symbols: list[str]) -> dict:
    """Train a SentencePiece BPE (byte fallback) model with Gemma's id layout.

    Writes tokenizer.model + tokenizer_config.json; returns prompt ids with BOS.
    """
    import sentencepiece as spm

    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / "tokenizer"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_lines()),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=vocab_size,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=user_symbols,
        byte_fallback=True,
        # Gemma's SPM keeps whitespace as is and does not add a dummy prefix.
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=1.0,
        num_threads=1,
        hard_vocab_limit=True,
        minloglevel=2,
    )
    os.remove(str(prefix) + ".vocab")  # not read by anything; keep the dir minimal
    # The trainer records the (machine-specific) output path inside the model;
    # blank it so the model file, and the GGUF built from it, are byte-stable.
    from sentencepiece import sentencepiece_model_pb2 as pb
    proto = pb.ModelProto()
    proto.ParseFromString((out_dir / "tokenizer.model").read_bytes())
    proto.trainer_spec.model_prefix = "tokenizer"
    (out_dir / "tokenizer.model").write_bytes(proto.SerializeToString())
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    assert sp.get_piece_size() == vocab_size
    cfg = {
        "tokenizer_class": "GemmaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    ids = [GEMMA_SPECIAL["<bos>"]] + sp.encode(PROMPT)
    return {"ids": ids, "bos_id": 2, "eos_id": 1, "kind": "spm"}


def build_spm_hf(out_dir: Path, vocab_size: int, user_symbols: list[str]) -> dict:
    """Gemma 4 style: the SPM model of build_spm, shipped as an HF tokenizer.json
    (BPE with byte fallback, Metaspace-like normaliser) and no tokenizer.model,
    which is what llama.cpp's gemma4 converter reads (gguf.LlamaHfVocab)."""
    from transformers import GemmaTokenizer

    info = build_spm(out_dir, vocab_size, user_symbols)
    # GemmaTokenizer would append a <mask> token past the vocab; Gemma's real
    # vocab has no such extra id, and the converter insists on vocab_size ids.
    t = GemmaTokenizer.from_pretrained(str(out_dir), mask_token=None)
    (out_dir / "tokenizer.model").unlink()
    (out_dir / "tokenizer_config.json").unlink()
    t.save_pretrained(str(out_dir))
    cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    for k in ("vocab_file", "is_local", "local_files_only"):  # machine-specific, unused
        cfg.pop(k, None)
    cfg["add_bos_token"] = True
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    j = json.loads((out_dir / "tokenizer.json").read_text())
    if any(a["id"] >= vocab_size for a in j["added_tokens"]):
        raise RuntimeError("tokenizer.json has added tokens past vocab_size")
    assert len(j["model"]["vocab"]) == vocab_size
    ids = t.encode(PROMPT)
    if ids != info["ids"]:
        raise RuntimeError("HF conversion of the SPM model tokenizes the prompt differently")
    info["kind"] = "spm-as-tokenizer.json"
    return info
