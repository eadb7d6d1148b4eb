"""Expert parallelism: which rank holds which experts (placement), and, to come, dispatch and combine."""
