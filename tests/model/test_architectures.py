"""Each supported architecture, as a tiny random Hugging Face checkpoint, against transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import load_model
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings

TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
)


def tiny_checkpoint(tmp_path: Path, architecture: str) -> tuple[Path, torch.nn.Module]:
    import transformers

    if architecture == "llama3":
        config = transformers.LlamaConfig(
            **TINY, tie_word_embeddings=False, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64},
        )
        model = transformers.LlamaForCausalLM(config)
    elif architecture == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, tie_word_embeddings=True))
    elif architecture == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=None))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=True))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # larger than init so that greedy tokens vary
    model.save_pretrained(tmp_path)
    return tmp_path, model.eval()


@pytest.mark.parametrize("architecture", ["llama", "llama3", "qwen2", "mistral"])
def test_tiny_checkpoint_greedy_matches_transformers(tmp_path: Path, architecture: str) -> None:
    folder, reference = tiny_checkpoint(tmp_path, architecture)
    loaded = load_model(folder)
    settings = EngineSettings(model=ModelSettings(path=str(folder), dtype="float32", device="cpu"),
                              kv_cache=KVCacheSettings(memory_bytes=2**24, block_size=16))
    engine = Engine(settings, loaded)
    prompts = [[5, 17, 33], list(range(1, 80)), [7] * 40 + list(range(100, 130))]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.req_id] += out.new_token_ids
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                          do_sample=False)[0, len(prompt):].tolist()
        assert outputs[str(i)] == expected, f"{architecture} prompt {i}"
    engine.check_invariants()


def test_hf_folder_and_gguf_give_the_same_weights(tmp_path: Path, model_path: str) -> None:
    import json
    import os

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder, file = os.path.split(model_path)
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # transformers refuses to re-save a GGUF-quantised model, so write the checkpoint by hand
    config = reference.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    from_gguf = load_model(model_path)
    from_folder = load_model(tmp_path)
    assert from_gguf.config.num_layers == from_folder.config.num_layers == 30
    assert from_gguf.config.num_kv_heads == from_folder.config.num_kv_heads == 3
    for name, tensor in from_folder.weights.items():
        assert torch.equal(tensor, from_gguf.weights[name]), name
