"""Run llama.cpp's convert_hf_to_gguf.py on a fixture model, unchanged but for
one patch: the BPE pre-tokenizer name.

The converter identifies a BPE pre-tokenizer by hashing how the tokenizer
encodes a fixed test string, and refuses tokenizers it does not know. Our tiny
trained tokenizers match no real model, so we make `get_vocab_base_pre` return
the name that the family's real GGUFs carry (e.g. "qwen2" for Qwen3-MoE).
With --raw-config-keys, a second patch: the converter loads config.json
through transformers' AutoConfig, and transformers 5 absorbs some checkpoint
keys into its own names without writing them back (MiniMax-M3's
sparse_attention_config, moe_layer_freq). Keys of the raw config.json (top
level and text_config) that the AutoConfig dict lacks are added back, values
unchanged, so the converter sees the checkpoint's config as written.
--raw-config-prefer K1,K2 goes further for the named keys: the raw value
replaces the one transformers resolved (Qwen4-Exp: its config class renames
layer_types' "full_attention" to "indexed_attention", the converter looks for
the checkpoint's "full_attention").

Everything else (tensor names, metadata keys, permutations, +1 norm shifts)
is the converter's own code.

usage: convert_wrapper.py --llamacpp DIR --pre NAME [--raw-config-keys] [--raw-config-prefer K,..] [converter args...]
"""

import sys
from pathlib import Path


def main() -> None:
    argv = sys.argv[1:]
    llamacpp = Path(argv[argv.index("--llamacpp") + 1])
    pre = argv[argv.index("--pre") + 1]
    raw_keys = "--raw-config-keys" in argv
    prefer = argv[argv.index("--raw-config-prefer") + 1].split(",") if "--raw-config-prefer" in argv else []
    with_value = ("--llamacpp", "--pre", "--raw-config-prefer")
    rest = [a for i, a in enumerate(argv)
            if a not in with_value + ("--raw-config-keys",)
            and (i == 0 or argv[i - 1] not in with_value)]

    # The bundled gguf-py, not any PyPI `gguf`: its constants are the ones this
    # converter was written against.
    sys.path.insert(0, str(llamacpp / "gguf-py"))
    sys.path.insert(0, str(llamacpp))

    from conversion import base  # noqa: E402  (path set up above)

    def fixed_pre(self, tokenizer):  # noqa: ARG001
        return pre

    base.TextModel.get_vocab_base_pre = fixed_pre

    if raw_keys or prefer:
        import json

        orig_load = base.ModelBase.load_hparams

        def load_hparams(dir_model, is_mistral_format):
            config = orig_load(dir_model, is_mistral_format)
            raw = json.loads((Path(dir_model) / "config.json").read_text())
            pairs = [(raw, config)]
            if isinstance(raw.get("text_config"), dict) and isinstance(config.get("text_config"), dict):
                pairs.append((raw["text_config"], config["text_config"]))
            for r, c in pairs:
                for k, v in r.items():
                    if k in prefer:
                        c[k] = v
                    elif raw_keys:
                        c.setdefault(k, v)
            return config

        base.ModelBase.load_hparams = staticmethod(load_hparams)

    import convert_hf_to_gguf  # noqa: E402

    sys.argv = [str(llamacpp / "convert_hf_to_gguf.py")] + rest
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
