"""Run by tests/integrations/test_lightning_fsdp2.py: Lightning's ModelParallelStrategy (FSDP2) on 2 CPU
processes with FxampPrecision; configure_model converts in place and shards.  Writes each rank's losses."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

import fxamp  # noqa: E402
from fxamp.lightning import FxampPrecision  # noqa: E402
from tests.training.test_fsdp2 import GPT, _batch  # noqa: E402

STEPS = 5


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT()
        self.losses = []

    def configure_model(self):
        if fxamp.conversion_info(self.model) is None:
            fxamp.convert_(self.model, "O1", dtype=torch.bfloat16)
            fxamp.shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, ids, i):
        loss = self.model(ids)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([_batch("gpt", self.global_rank, s)[0] for s in range(STEPS)],
                                           batch_size=None)


if __name__ == "__main__":
    torch.set_num_threads(1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, gradient_clip_val=1.0,
                         strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                         plugins=[FxampPrecision("O1", "bf16")], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)  # (each rank its own batches, as in the reference)
    lm = LM()
    trainer.fit(lm)
    with open(os.path.join(sys.argv[1], f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(lm.losses, f)
