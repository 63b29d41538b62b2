"""Reference logits for gemma-3-270m Q4_K_M from HF transformers.

transformers loads the same GGUF (`gguf_file=`), dequantizing every tensor to
float32, and runs Gemma3ForCausalLM on a fixed English text. For each position
we keep the top-K next-token ids with their logits and the log-sum-exp of the
whole row, which is enough to compute top-1 agreement and a KL divergence over
the reference's top-K (plus one bucket for the remaining mass) in `cargo test`
without torch. Output: fixtures/gemma3-270m/reference.json.

Usage: python tools/gemma-ref/gen.py [MODEL.gguf]   (requirements.txt beside this file)
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TOP_K = 32
TEXT = (
    "The history of the city begins on a small island in the river, where a fishing village grew into a market town. "
    "Over the centuries, merchants built bridges to both banks, and the town spread along the water. By the twelfth "
    "century it had a cathedral, a university and a busy port, and its rulers made it the capital of the kingdom. "
    "Travellers wrote about its narrow streets, its bakeries and the noise of the bells on Sunday mornings. In the "
    "nineteenth century engineers rebuilt much of the centre: they cut wide avenues through the old quarters, laid "
    "sewers and water pipes, and planted trees along the boulevards. Railways reached the city, and with them came "
    "factories, new suburbs and millions of workers from the countryside. Today the city is known for its museums, "
    "its parks and its food. Every year visitors come to walk along the river, to climb the towers of the cathedral "
    "and to sit in the cafes that line the squares. Yet the people who live there still complain about the rent, "
    "the traffic and the weather, as people in every great city always have. The mayor has promised more buses, "
    "cheaper housing and cleaner air, and most residents hope that this time the promises will be kept."
)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/pulsar/models/gemma-3-270m-Q4_K_M.gguf")
    d, f = os.path.split(path)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    model.eval()
    ids = tok(TEXT, add_special_tokens=True)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lse = torch.logsumexp(logits, dim=-1)
    top = torch.topk(logits, TOP_K, dim=-1)
    out = {
        "model": "gemma-3-270m Q4_K_M (sha256 a5fd3b62...6818)",
        "reference": "transformers %s, torch %s, float32, Gemma3ForCausalLM from the GGUF" % (
            __import__("transformers").__version__, torch.__version__),
        "text": TEXT,
        "tokens": ids,
        "top_k": TOP_K,
        "positions": [
            {
                "ids": top.indices[i].tolist(),
                "logits": [round(x, 5) for x in top.values[i].tolist()],
                "lse": round(float(lse[i]), 5),
            }
            for i in range(len(ids))
        ],
    }
    here = os.path.dirname(os.path.abspath(__file__))
    dest = os.path.join(here, "..", "..", "fixtures", "gemma3-270m", "reference.json")
    with open(dest, "w") as fh:
        json.dump(out, fh, separators=(",", ":"))
    print("wrote", dest, len(ids), "positions")


if __name__ == "__main__":
    main()
