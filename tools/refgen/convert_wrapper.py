"""Run llama.cpp's convert_hf_to_gguf.py on a fixture model, unchanged but for
one patch: the BPE pre-tokenizer name.

The converter identifies a BPE pre-tokenizer by hashing how the tokenizer
encodes a fixed test string, and refuses tokenizers it does not know. Our tiny
trained tokenizers match no real model, so we make `get_vocab_base_pre` return
the name that the family's real GGUFs carry (e.g. "qwen2" for Qwen3-MoE).
Everything else (tensor names, metadata keys, permutations, +1 norm shifts)
is the converter's own code.

usage: convert_wrapper.py --llamacpp DIR --pre NAME [converter args...]
"""

import sys
from pathlib import Path


def main() -> None:
    argv = sys.argv[1:]
    llamacpp = Path(argv[argv.index("--llamacpp") + 1])
    pre = argv[argv.index("--pre") + 1]
    rest = [a for i, a in enumerate(argv)
            if a not in ("--llamacpp", "--pre") and (i == 0 or argv[i - 1] not in ("--llamacpp", "--pre"))]

    # The bundled gguf-py, not any PyPI `gguf`: its constants are the ones this
    # converter was written against.
    sys.path.insert(0, str(llamacpp / "gguf-py"))
    sys.path.insert(0, str(llamacpp))

    from conversion import base  # noqa: E402  (path set up above)

    def fixed_pre(self, tokenizer):  # noqa: ARG001
        return pre

    base.TextModel.get_vocab_base_pre = fixed_pre

    import convert_hf_to_gguf  # noqa: E402

    sys.argv = [str(llamacpp / "convert_hf_to_gguf.py")] + rest
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
