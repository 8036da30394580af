"""The policy a train worker holds in memory: its model, AdamW optimizer, tokenizer and KL
reference, loaded from a checkpoint or kept from the update it made last (``--serve``),
and moved to host memory between updates when engines share its GPU (``offload``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from orchestrator import checkpoints
from orchestrator.checkpoints import deltas, manifest, optimizer_state, sharded
from orchestrator.train import lora, parallel, precision
from orchestrator.train.errors import BadTrainInput, TrainerError
from orchestrator.train.rendezvous import Rendezvous
from orchestrator.train.request import TrainRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Setup:
    """What a model in memory was prepared for; another setup loads it again."""

    strategy: str
    mixed_precision: str
    activation_checkpointing: bool
    lora: tuple = ()
    """(rank, alpha, dropout, target modules) with LoRA; () without."""

    @classmethod
    def of(cls, config: TrainRequest) -> "Setup":
        lora = (config.train.lora_rank, config.train.lora_alpha, config.train.lora_dropout, tuple(config.train.lora_target_modules)) if config.train.lora_rank else ()
        return cls(config.train.strategy, config.train.mixed_precision, config.train.activation_checkpointing, lora)

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"


def _load_model(path: Path, device, setup: Setup, world_size: int, lora_from: TrainRequest | None = None):
    """The Hugging Face model at ``path`` in fp32 whatever its saved dtype (a frozen LoRA base
    may keep its own: precision.py), with LoRA adapters when ``lora_from`` is given (new, or
    those of its init checkpoint: lora.attach), prepared for ``setup``'s strategy (parallel.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    dtype = precision.load_dtype(path, frozen=lora_from is not None, mixed_precision=setup.mixed_precision)
    master = checkpoints.master_dir(path) if lora_from is None else None
    # Eval mode throughout: no dropout, so the first step's ratio is exactly what the
    # precomputed old log-probs say it is. Gradients (and their reduction) do not depend on it.
    if master is not None:  # the published weights are rounded (publish.dtype) or a delta: the fp32 master goes on
        config = AutoConfig.from_pretrained(path)
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:  # a model without generation_config.json: what transformers makes of its config
            generation = GenerationConfig.from_model_config(config)
        model, loading = AutoModelForCausalLM.from_pretrained(master, config=config, generation_config=generation, use_safetensors=True,
                                                              dtype=dtype, output_loading_info=True)
        model.eval()
        saved = {n for n, _ in sharded.model_tensors(model)}  # tied parameters once: a tied one is never "missing"
        missing = sorted(n for n in loading["missing_keys"] if n in saved)
        if missing:  # from_pretrained leaves a missing tensor at its random initial value
            raise BadTrainInput(f"{master}: its master weights do not fit the model (missing {missing[:3]})")
    else:
        if deltas.needs_base(path):
            raise BadTrainInput(f"{path} holds no training state (checkpoint.state_every): its weights are a delta for the engines; "
                                f"a trainer starts from a checkpoint with its state and trains the iterations after it again")
        model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, dtype=dtype).eval()
    if lora_from is not None:
        model = lora.attach(model, lora_from).eval()
        precision.to_master(model)
    if not setup.sharded:
        model.to(device)  # FSDP moves each block to the device as it shards it: one whole block on the GPU at a time
    try:
        return parallel.prepare(model, strategy=setup.strategy, device=device, world_size=world_size,
                                mixed_precision=setup.mixed_precision, activation_checkpointing=setup.activation_checkpointing)
    except ValueError as e:
        raise BadTrainInput(f"{path}: {e}") from None


class Policy:
    """One train worker's model, optimizer, tokenizer and KL reference, inside a formed
    process group. Kept across updates by ``--serve``; a one-shot run makes a single update."""

    def __init__(self, rdv: Rendezvous, device):
        self.rdv = rdv
        self.device = device
        self.model = None
        self.optimizer = None
        self.tokenizer = None
        self.setup: Setup | None = None
        self.pad_id = 0
        self.holds: int | None = None  # the iteration whose update the model holds (None: loaded, or nothing)
        self.continued_from: int | None = None
        self._reference = None  # ((path, setup), model)
        self.base: Path | None = None  # with LoRA: the base model under the adapters
        self.served_dtype = precision.MASTER  # the dtype the engines serve, which every checkpoint's config.json names
        self.offloaded = False

    def load(self, config: TrainRequest) -> str:
        """Make the model and optimizer those of ``config.init_checkpoint``; returns how:
        ``memory``, ``checkpoint``, or ``state`` when the init checkpoint holds no training
        state and the one the replay starts from was loaded instead (``config.replay``: the
        caller trains those iterations again)."""
        import dataclasses

        import torch

        setup = Setup.of(config)
        if self.model is not None and self.holds is not None and config.init_iteration == self.holds and setup == self.setup:
            self._onload()
            self.count_steps()
            return "memory"
        from transformers import AutoTokenizer

        how = "checkpoint"
        if config.replay:  # the state of the iteration before the first replayed, then the replay makes init's
            config = dataclasses.replace(config, init_checkpoint=config.replay_from, init_iteration=config.replay_from_iteration,
                                         seed=config.replay[0].seed, replay=())
            how = "state"

        self.model = self.optimizer = None
        if config.init_iteration is not None:  # a checkpoint of the run, read whole here: checked first (the base has no manifest)
            try:
                manifest.verify(config.init_checkpoint, manifest.ALL)
            except manifest.CheckpointCorrupt as e:
                raise TrainerError(str(e)) from None
        self.tokenizer = AutoTokenizer.from_pretrained(config.base_model if setup.lora else config.init_checkpoint)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        if setup.lora:  # the base, from this node's model.path, with the adapter of the init checkpoint (or new ones)
            self.model = _load_model(config.base_model, self.device, setup, self.rdv.world_size, lora_from=config)
            self.base = config.base_model
            self.served_dtype = precision.checkpoint_dtype(config.base_model)
        else:
            self.model = _load_model(config.init_checkpoint, self.device, setup, self.rdv.world_size)
            self.served_dtype = precision.checkpoint_dtype(config.init_checkpoint)
        self.setup = setup
        trained = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapters only
        self.optimizer = torch.optim.AdamW(trained, lr=config.rl.lr, weight_decay=0.0)
        try:
            self.continued_from = optimizer_state.load(self.optimizer, self.model, config.init_checkpoint)
        except ValueError as e:
            raise BadTrainInput(str(e)) from None
        self.offloaded = False
        return how

    def reference(self, config: TrainRequest):
        """The KL reference model, loaded once per path, sharded as the policy is (no gradients,
        no optimizer, no activation checkpointing)."""
        if self._reference is None or self._reference[0] != (config.reference_checkpoint, self.setup):
            setup = Setup(self.setup.strategy, self.setup.mixed_precision, False)  # no adapters: the reference is a whole model
            model = _load_model(config.reference_checkpoint, self.device, setup, self.rdv.world_size)
            model.requires_grad_(False)
            self._reference = ((config.reference_checkpoint, self.setup), model)
        return self._reference[1]

    def _move(self, device) -> None:
        for p in self.model.parameters():
            p.data = p.data.to(device)
            p.grad = None
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if key != "step":
                    state[key] = value.to(device)

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to host memory; the GPU's cache freed."""
        import torch

        if self.device.type != "cuda" or self.offloaded:
            return
        if self.setup.sharded:
            log.warning("train.strategy=fsdp keeps its shards on the GPU between updates (offload is for ddp)")
            return
        self._move(torch.device("cpu"))
        if self._reference is not None:
            self._reference = None  # reloaded next time: keeping it would hold the GPU
        torch.cuda.empty_cache()
        self.offloaded = True

    def count_steps(self) -> None:
        """``continued_from``: the steps the optimizer in memory has made (None: none)."""
        self.continued_from = int(max((s["step"].item() for s in self.optimizer.state.values()), default=0)) or None

    def _onload(self) -> None:
        if self.offloaded:
            self._move(self.device)
            self.offloaded = False
