"""Does an exported zeroflow checkpoint mean the same model to Hugging Face `transformers`?

Loads the export directory with `GPT2LMHeadModel.from_pretrained` (fp32, CPU), runs the tokens
that zeroflow's own forward ran (`crates/zeroflow-gpt/examples/hf_logits.rs` wrote them with its
logits), and prints one JSON object: the largest absolute logit difference, the relative norm of
the difference, both losses, and the keys `transformers` reported missing or unexpected.

    python3 bench/peers/hf_logits_check.py EXPORT_DIR zeroflow_logits.json
"""

import json
import sys

import torch
from transformers import GPT2LMHeadModel


def main() -> None:
    export_dir, logits_file = sys.argv[1], sys.argv[2]
    theirs = json.load(open(logits_file))
    model, info = GPT2LMHeadModel.from_pretrained(
        export_dir, torch_dtype=torch.float32, output_loading_info=True
    )
    model.eval()
    tokens = torch.tensor([theirs["tokens"]])
    with torch.no_grad():
        logits = model(tokens).logits[0].double()
    ours = torch.tensor(theirs["logits"], dtype=torch.float64)
    targets = torch.roll(tokens[0], -1)
    hf_loss = torch.nn.functional.cross_entropy(logits, targets).item()
    result = {
        "tokens": len(theirs["tokens"]),
        "vocab": logits.shape[1],
        "max_abs_diff": (logits - ours).abs().max().item(),
        "rel_norm_diff": ((logits - ours).norm() / logits.norm()).item(),
        "loss_transformers": hf_loss,
        "loss_zeroflow": theirs["loss"],
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
