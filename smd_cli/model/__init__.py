"""A model and its numerics: building or loading it and its tokenizer (`build`), where its weights come from
(`weights`, `local_dir`), float32 masters for bf16 compute (`precision`), the row floor of few-row matmuls
(`row_floor`) and the float64 widening of one layer at a time (`widening`)."""
