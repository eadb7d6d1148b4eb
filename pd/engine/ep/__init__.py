"""Expert parallelism: which rank holds which expert replicas (placement) and the load it places by
(load); dispatch and combine are to come."""
