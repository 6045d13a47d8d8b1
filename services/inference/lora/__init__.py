"""LoRA adapters served by the inference stage: checked against the base model, preloaded, never merged.

* `peftconfig`: which `adapter_config.json` this build understands (anything else is refused).
* `weights`: an adapter's weights read and checked against the base; model/loraslots.py stacks the
  accepted ones by slot (slot 0 = the base model) and computes the LoRA term the forward pass adds,
  per token, so that a row's output never depends on its batch-mates.
* `fingerprint`: the facts about the base model an adapter is bound to.
* `checkprompts`: the check prompts and the teacher-forced check run (greedy ids and top-k log-probabilities).
* `manifest`: the `keel-adapter.json` record and the model card made from it.
* `registry`: registration (`register`), the start-up checks (`load_registry`) and request-time resolution.
* `startcache`: the start-up record under var/warm that lets a restart reuse the checks' check runs.
"""
