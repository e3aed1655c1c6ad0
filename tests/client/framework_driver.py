"""Runs one episode through a real RL framework's own code with the client's adapter, in the frameworks'
environment (ROLLOUTFLEET_FRAMEWORKS_PYTHON: verl and AReaL cannot be installed beside the proxy), and
prints what the framework got as JSON. Run by test_framework_adapters_verl_areal.py:

    python framework_driver.py '{"framework": "verl", "scenario": "tool", ...}'

The fleet is found as in production, from ROLLOUTFLEET_ENDPOINTS and ROLLOUTFLEET_ADMIN_KEY. Scenarios
(what the agent does, with the official openai client, the session's base URL and api_key "EMPTY"):
  tool    asks 12 + 30 offering the calculator, answers the model's call, takes the answer (reward 1.0
          when it says 42);
  length  two turns of `max_tokens` 6 (both cut at their budget), reward 0.5;
  update  one turn of up to 60 tokens at the framework's temperature, no reward (the test updates the
          engines' weights while it runs).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI
from rolloutfleet_client.calculator import run_tool_call

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
QUESTIONS = {
    "tool": "What is 12 + 30?",
    "length": "Tell me a long story.",
    "update": "Tell me about weight updates.",
}
# The emulated engines sample deterministically given a seed (as SGLang does with
# --enable-deterministic-inference): with this one the length scenario's turns reach their budget,
# and the update scenario's turn makes 33 tokens before EOS under the old weights.
SEED = 1234
# What the agents saw, per scenario run: each reply's finish_reason and text (the test compares them
# with the framework's structure).
SEEN: list[dict[str, Any]] = []


async def converse(
    scenario: str, base_url: str, api_key: str, messages: list[dict], temperature: float, http_client=None
) -> float | None:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client)
    messages = list(messages)

    async def turn(**params: Any) -> Any:
        reply = await client.chat.completions.create(model="policy", messages=messages, **params)
        choice = reply.choices[0]
        SEEN.append({"finish_reason": choice.finish_reason, "content": choice.message.content or ""})
        messages.append(choice.message.model_dump(exclude_none=True))
        return choice.message

    if scenario == "tool":
        called = await turn(tools=[CALCULATOR], max_tokens=64)
        for call in called.tool_calls or []:
            result = run_tool_call(call.model_dump())
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        answer = await turn(tools=[CALCULATOR], max_tokens=64)
        return 1.0 if "42" in (answer.content or "") else 0.0
    if scenario == "length":
        await turn(max_tokens=6, temperature=temperature, seed=SEED)
        messages.append({"role": "user", "content": "Go on."})
        await turn(max_tokens=6, temperature=temperature, seed=SEED)
        return 0.5
    await turn(max_tokens=60, temperature=temperature, seed=SEED)
    return None


# --- verl: the user's agent as verl's agent loop config names it (`agent: framework_driver:...`) ---


async def verl_agent(run, sampling_params: dict, raw_prompt, scenario: str, **row) -> float | None:
    return await converse(
        scenario, run.base_url, run.api_key, list(raw_prompt), sampling_params["temperature"]
    )


async def run_verl(spec: dict) -> dict:
    import numpy as np
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry
    from verl.protocol import DataProto
    from verl.utils.dataset.rl_dataset import RLHFDataset

    # The agent loop config file verl users write (rollout.agent.agent_loop_config_path).
    loops = Path(spec["work_dir"]) / "agent_loops.yaml"
    loops.write_text(
        "- name: rolloutfleet\n"
        "  _target_: rolloutfleet_client.adapters.verl.FleetAgentLoop\n"
        "  agent: framework_driver:verl_agent\n"
    )
    rollout = {
        "prompt_length": spec["prompt_length"],
        "response_length": spec["response_length"],
        "temperature": 0.8,
        "top_p": 1.0,
        "top_k": -1,
        "calculate_log_probs": True,
        "val_kwargs": {"top_p": 1.0, "top_k": -1, "temperature": 0.0},
        "agent": {"agent_loop_config_path": str(loops), "default_agent_loop": "rolloutfleet"},
        "multi_turn": {},
        "trace": {},
    }
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}, "data": {}})
    # AgentLoopWorker.__init__ loads the policy's HF checkpoint (HFModelConfig) and Ray handles, which
    # this machine has no model for: the worker gets the attributes its __init__ sets, then registers
    # the config file's loops as its __init__ does; everything after that is verl's own code.
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.config = config
    worker.rollout_config = config.actor_rollout_ref.rollout
    worker.llm_client = None  # the agent's requests go to the fleet, not to verl's server manager
    worker.teacher_client = None
    worker.reward_loop_worker_handles = None
    worker.tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    worker.processor = None
    worker.hf_model_type = None
    worker.dataset_cls = RLHFDataset
    worker.mm_processor_kwargs = {}
    worker.distillation_enabled = False
    worker.tools = []
    for loop in OmegaConf.load(loops):
        _agent_loop_registry[loop.name] = loop

    messages = [{"role": "user", "content": QUESTIONS[spec["scenario"]]}]
    batch = DataProto(
        non_tensor_batch={
            "raw_prompt": np.array([messages], dtype=object),
            "agent_name": np.array(["rolloutfleet"], dtype=object),
            "index": np.array([7]),
            "scenario": np.array([spec["scenario"]], dtype=object),
        },
        meta_info={"global_steps": 1, "validate": False},
    )
    output = await worker.generate_sequences(batch)
    # A TensorDict iterates over its batch dimension, not its keys.
    tensors = {key: output.batch[key][0].tolist() for key in output.batch.keys()}  # noqa: SIM118
    extras = {
        key: (value[0].item() if hasattr(value[0], "item") else value[0])
        for key, value in output.non_tensor_batch.items()
        if key not in ("raw_prompt", "agent_name", "index", "scenario")
    }
    return {"tensors": tensors, "non_tensor": extras, "pad_token_id": worker.tokenizer.pad_token_id}


# --- AReaL: the user's agent is AReaL's kind (an object with `async run(data, **extra_kwargs)`) ----


class ArealAgent:
    async def run(self, data: dict, **extra_kwargs: Any) -> float | None:
        return await converse(
            data["scenario"],
            extra_kwargs["base_url"],
            extra_kwargs["api_key"],
            data["messages"],
            0.8,
            extra_kwargs.get("http_client"),
        )


async def run_areal(spec: dict) -> dict:
    from areal.infra.workflow_executor import check_trajectory_format
    from areal.utils.data import concat_padded_tensors
    from rolloutfleet_client.adapters.areal import FleetWorkflow

    workflow = FleetWorkflow(ArealAgent())
    data = {
        "messages": [{"role": "user", "content": QUESTIONS[spec["scenario"]]}],
        "scenario": spec["scenario"],
    }
    # AReaL's WorkflowExecutor hands its inference engine; the adapter's agent goes through the fleet.
    trajectory = await workflow.arun_episode(None, data)
    assert check_trajectory_format(trajectory), "AReaL refused the trajectory's format"
    batched = concat_padded_tensors([trajectory, trajectory])  # as AReaL batches episodes
    return {
        "tensors": {key: value.tolist() for key, value in trajectory.items()},
        "dtypes": {key: str(value.dtype) for key, value in trajectory.items()},
        "shapes": {key: list(value.shape) for key, value in trajectory.items()},
        "batched_shapes": {key: list(value.shape) for key, value in batched.items()},
    }


def main() -> None:
    # verl imports the agent by its config's name (framework_driver:verl_agent): let that be this
    # module, so what its agents saw is in this SEEN.
    sys.modules.setdefault("framework_driver", sys.modules[__name__])
    spec = json.loads(sys.argv[1])
    run = run_verl if spec["framework"] == "verl" else run_areal
    result = asyncio.run(run(spec))
    print(json.dumps({**result, "seen": SEEN}))


if __name__ == "__main__":
    main()
