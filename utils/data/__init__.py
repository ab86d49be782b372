"""The data layer, one module per role, bottom up (each imports only modules above it in this list):
  draws      the keyed draws: every random choice of the data path from (seed, epoch, sample index), and a batch's
             record of them (`Draws`); a leaf
  pixels     all pixel work of decoding: opening an encoded image, its views (the cache's resize; the crop recipe for
             natural images, --augment resized-crop, and its evaluation view)
  transform  the batch's transforms on its pixels: --auto-augment's per-image policies, and `BatchTransform` (crop,
             flip, erasing, mixing and normalisation on the device)
  sources    where encoded rows come from (`EncodedRows`): parquet files, an image folder, a Hub dataset, a copy's
             own torch Dataset (any image size); evaluation files that are training files byte for byte
  images     `Images`, the protocol every kind of a split's images implements for the loaders (its `read`: a batch of
             indices into uint8 pixels), its kinds (`TensorImages` in memory, `EncodedImages` decoded by batch in the
             loader's workers), the one loader dataset over any kind (`LoaderDataset`) and the training order
             (`EpochSampler`)
  decode     decoding once into the cache file, with each image's digest (evaluation images that are training images)
  stream     parquet or tar shards read as a stream (an `EncodedRows` kind), and their sampler
  builtin    the built-in sources for a template's load_data (--data-dir, --dataset, --decode)
  contract   load_data's contract (`checked_data`) and what summary.json records of the data
  loaders    the DataLoaders, from any `Images` (the protocol only)
A batch: load_data -> checked_data (each split an `Images`) -> build_loaders (a LoaderDataset over the kind's `read`,
its `sampler` and `workers`) -> accelerator.prepare (sharding) -> BatchTransform.train on the device -> the model.
Its pixels pass through at most 4 of these modules on every decode path: images (LoaderDataset, the kind's `read`)
-> on the encoded paths sources or stream (the encoded bytes) -> pixels (decoded into the view) -> transform."""
