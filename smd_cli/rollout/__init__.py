"""The sampler: batched generation under an evicting cache that records the shadow mask (`sampler`), the sampled
token sets and the one log-prob formula (`sampling`), CUDA-graph decode steps (`cuda_graphs`) and the adaptive
compression controller (`adaptive`)."""
