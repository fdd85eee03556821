"""The engine counts where its steps spend their time, and a worker's /metrics shows it."""

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_phases import PHASES
from shared.metrics import WorkerMetrics
from shared.model.loader import LoadedModel
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings


def test_every_phase_of_a_step_is_counted_and_exported(loaded_model: LoadedModel) -> None:
    engine = Engine(EngineSettings(model=ModelSettings(dtype="float32", device="cpu"),
                                   kv_cache=KVCacheSettings(memory_bytes=2**26)), loaded_model)
    assert set(engine.phases.seconds) == set(PHASES) and not any(engine.phases.seconds.values())
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    assert engine.num_steps == 3
    assert all(seconds > 0 for seconds in engine.phases.seconds.values()), engine.phases.seconds

    metrics = WorkerMetrics("m", "w")
    metrics.track_engine_steps(lambda: engine.phases.seconds, lambda: engine.num_steps)
    text = metrics.render().decode()
    for phase in PHASES:
        assert f'llmd_engine_phase_seconds_total{{model_name="m",phase="{phase}",worker_id="w"}}' in text
    assert 'llmd_engine_steps{model_name="m",worker_id="w"} 3.0' in text
