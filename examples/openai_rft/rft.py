"""A reinforcement fine-tuning script written for OpenAI's API. It runs against Taper unchanged: point the official
client at Taper with OPENAI_BASE_URL (Taper's address + /v1) and OPENAI_API_KEY (a Taper key), and have the
operator alias the model it names (TAPER_MODEL_ALIASES='{"o4-mini-2025-04-16": "small"}').

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=tpr_... python examples/openai_rft/rft.py
"""

from __future__ import annotations

import time
from pathlib import Path

from openai import OpenAI

HERE = Path(__file__).parent
client = OpenAI()

# 1. the data: prompts in chat form, each with the reference answer the grader reads as {{item.answer}}
train = client.files.create(file=(HERE / "train.jsonl").open("rb"), purpose="fine-tune")
valid = client.files.create(file=(HERE / "valid.jsonl").open("rb"), purpose="fine-tune")

# 2. the grader, tried on a sample before any job spends compute on it
grader = {
    "type": "python",
    "name": "states_the_sum",
    "source": (
        "def grade(sample, item):\n"
        "    return 1.0 if sample['output_text'].rstrip('.').endswith(item['answer']) else 0.0\n"
    ),
}
client.fine_tuning.alpha.graders.validate(grader=grader)
trial = client.fine_tuning.alpha.graders.run(grader=grader, model_sample="The answer is 42.", item={"answer": "42"})
assert trial.reward == 1.0, trial
print(f"grader ok: reward {trial.reward} in {trial.metadata.execution_time:.2f}s")

# 3. the job
job = client.fine_tuning.jobs.create(
    model="o4-mini-2025-04-16",
    training_file=train.id,
    validation_file=valid.id,
    suffix="sums",
    seed=7,
    metadata={"experiment": "rft-sums"},
    method={
        "type": "reinforcement",
        "reinforcement": {
            "grader": grader,
            "hyperparameters": {"n_epochs": 1, "batch_size": 4, "eval_interval": 2, "compute_multiplier": 0.5},
        },
    },
)
print(f"created {job.id} ({job.status})")

# 4. wait for it, as RFT scripts do
while job.status not in ("succeeded", "failed", "cancelled"):
    time.sleep(2)
    job = client.fine_tuning.jobs.retrieve(job.id)
    print(f"{job.id}: {job.status}" + (f", done by {job.estimated_finish}" if job.estimated_finish else ""))

for event in client.fine_tuning.jobs.list_events(job.id, limit=5):
    print(f"  [{event.level}] {event.message}")
for checkpoint in client.fine_tuning.jobs.checkpoints.list(job.id):
    print(f"  checkpoint {checkpoint.fine_tuned_model_checkpoint}: {checkpoint.metrics.to_dict()}")
if job.status != "succeeded":
    raise SystemExit(f"{job.id} {job.status}: {job.error.message if job.error else ''}")
results = client.files.content(job.result_files[0]).text
print(f"succeeded: fine_tuned_model={job.fine_tuned_model}, trained_tokens={job.trained_tokens}")
print(results.splitlines()[0])
