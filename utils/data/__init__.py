"""The data layer, one module per role, bottom up (each imports only modules above it in this list):
  draws      the keyed draws: every random choice of the data path from (seed, epoch, sample index), and a batch's
             record of them (`Draws`); a leaf
  pixels     all pixel work: opening an encoded image, its views (the cache's resize; the crop recipe for natural
             images, --augment resized-crop, and its evaluation view)
  policies   --auto-augment: TrivialAugment / RandAugment / AugMix drawn per image and applied by batch
  images     `Images`, the protocol every kind of a split's images implements for the loaders (its `read`: a batch of
             indices into uint8 pixels), the one loader dataset over any kind (`LoaderDataset`), the training order
             (`EpochSampler`), and the kind in memory (`TensorImages`: the cache's images, a copy's arrays)
  sources    where encoded rows come from: parquet files, an image folder, a Hub dataset (`EncodedRows`)
  decode     decoding once into the cache file
  stream     parquet or tar shards read as a stream, and their sampler
  encoded    the kind kept encoded, decoded by batch in the loader's workers
  items      a copy's own torch Dataset as encoded rows (any image size), decoded as the encoded kind is
  builtin    the built-in sources for a template's load_data (--data-dir, --dataset, --decode)
  contract   load_data's contract (`checked_data`) and what summary.json records of the data
  loaders    the DataLoaders, from any `Images` (the protocol only)
  transform  the batch's crop, flip, mixing and normalisation on the device
A batch: load_data -> checked_data (each split an `Images`) -> build_loaders (a LoaderDataset over the kind's `read`,
its `sampler` and `workers`) -> accelerator.prepare (sharding) -> BatchTransform.train on the device -> the model."""
