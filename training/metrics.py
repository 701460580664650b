"""What a run records: metrics.jsonl (always) and Weights & Biases (when enabled), one record per log
or eval line."""
import json
from pathlib import Path

from common import ConfigError, atomic_write
from training.config import Config


class Metrics:
    """metrics.jsonl and wandb. resume_step: keep the records up to that step, drop the rest (what a
    run killed after its last checkpoint logged is logged again when it resumes)."""

    def __init__(self, cfg: Config, out_dir: Path, resume_step: int | None):
        if cfg.log.wandb:   # before metrics.jsonl is touched
            try:
                import wandb
            except ImportError:
                raise ConfigError("log.wandb = true but wandb is not installed (pip install wandb)") from None
        self.path = out_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            atomic_write(self.path, "".join(l + "\n" for l in self.path.read_text().splitlines()
                                                 if self.step_of(l) <= resume_step))
        self.file = open(self.path, "a" if resume_step is not None else "w")
        self.wandb = None
        if cfg.log.wandb:
            try:
                self.wandb = wandb.init(project=cfg.log.wandb_project, name=cfg.log.wandb_run_name or out_dir.name,
                                        group=cfg.log.wandb_group or None, config=cfg.to_dict(), dir=str(out_dir),
                                        resume="allow")
            except BaseException:
                self.file.close()
                raise

    @staticmethod
    def step_of(line: str) -> float:
        """A record's step; inf for a line a kill cut short (so it is dropped)."""
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            return float("inf")

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k not in ("step", "kind")}, step=record["step"])

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class NoMetrics:
    """What ranks other than 0 record: nothing."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass
