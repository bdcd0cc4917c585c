"""The evicting rollout's decode step captured as CUDA graphs and replayed (`sampling.compile`), with an eager
fallback: a step that reads the device, or a capture that fails, warns once and decodes eagerly."""

from __future__ import annotations

import warnings

import torch


class DecodeGraphs:
    """The evicting rollout's decode step as CUDA graphs, one per `policy.decode_signature` (steps that run the
    same kernels on the same tensors share one).

    A signature's first step runs eagerly on a side stream (the warm-up a capture needs: lazy cuBLAS and
    kernel set-up), with the sync debug mode warning: a step that read the device could not be captured,
    so it is not tried. Its second step is captured, then replayed, and so is every later one. A replay reads
    and writes the same tensors as the capture: the fed token and position buffers and the cache's column
    and active rows (written in place before each step), the cache's slots and the state's records (updated
    in place by the step itself); its logits tensor is overwritten by the next replay. A failed capture (it
    runs nothing) warns once, and the rollout decodes eagerly from there on."""

    def __init__(self):
        self.graphs: dict = {}
        self.warm: set = set()
        self.failed = False

    def _give_up(self, why: str) -> None:
        self.failed = True
        warnings.warn(f"CUDA-graph capture of the decode step is off for this rollout ({why}); decoding eagerly", RuntimeWarning, stacklevel=4)

    def __call__(self, key, step):
        if self.failed or key is None:
            return step()
        if key in self.graphs:
            graph, logits = self.graphs[key]
            graph.replay()
            return logits
        main = torch.cuda.current_stream()
        if key not in self.warm:
            self.warm.add(key)
            side = torch.cuda.Stream()
            side.wait_stream(main)
            with torch.cuda.stream(side), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    logits = step()
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
            main.wait_stream(side)
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
            if syncs:
                self._give_up(f"the step reads the device: {syncs[0]}")
            return logits
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = step()
        except Exception as err:  # nothing ran: decode this step (and the rest) eagerly
            torch.cuda.set_stream(main)
            torch.cuda.synchronize()
            self._give_up(f"{type(err).__name__}: {err}")
            return step()
        self.graphs[key] = (graph, logits)
        graph.replay()
        return logits
