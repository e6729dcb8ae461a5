"""The training job: real text -> microbatches -> pipeline step -> optimizer, per rank."""
