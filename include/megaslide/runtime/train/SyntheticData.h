//===- SyntheticData.h - A learnable flow-matching task ---------*- C++ -*-===//
//
// The default data of megaslide-run: a fixed-seed set of smooth moving
// latent videos ("prototypes"), each with its own condition (text
// embeddings, or a class label for DiT). Every step draws a prototype per
// sample, a timestep t ~ U(0, 1) and Gaussian noise. Because the clean
// latents are a function of the condition, the velocity target is
// predictable and the loss falls well below its starting value; with
// random latents it could not.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_TRAIN_SYNTHETICDATA_H
#define MEGASLIDE_RUNTIME_TRAIN_SYNTHETICDATA_H

#include "megaslide/runtime/plan/Backend.h"
#include "megaslide/runtime/train/Random.h"

#include "megaslide/runtime/host/Safetensors.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace megaslide::train {

/// The shapes of a plan's step inputs, by name.
struct InputShapes {
  std::vector<int64_t> latents, timesteps, condition;
  bool conditionIsLabel = false; ///< DiT: integer class labels
  /// Further per-sample inputs [B, ...] in plan order, which every sample
  /// holds under their names: an image-conditioned model's image_embeds
  /// and image_condition (docs/Runtime.md, "Data files").
  std::vector<std::pair<std::string, std::vector<int64_t>>> extras;
  /// Reads them from the plan's inputs; errors name what is missing.
  static llvm::Expected<InputShapes> of(const exec::ExecPlan &plan);

  /// The per-sample tensors beside the latents, with one sample's shape:
  /// the condition (a label: [1]), then the extras.
  std::vector<std::pair<std::string, std::vector<int64_t>>>
  sampleTensors() const;
  /// Elements of one sample's conditioning block: its sampleTensors() one
  /// after another (what a data source's readSample writes).
  int64_t conditioningElements() const;
  /// Puts the block of sample `b` of a batch into the batch's inputs,
  /// sizing them at b = 0.
  void putConditioning(exec::StepInputs &inputs, int64_t b,
                       const float *block) const;
};

/// Where a run's batches come from. Every batch draws its samples, its
/// timesteps and its noise from one generator, so the generator's state is
/// all a checkpoint needs to continue the same sequence.
///
/// Batches can be made ahead on a thread of their own (`readAhead` of
/// them), so that reading sample files overlaps the step; the sequence is
/// the same either way, and state() is that of the batches handed out.
class DataSource {
public:
  virtual ~DataSource();
  /// The next batch; advances the sampling state. On error (a sample that
  /// cannot be read or holds a non-finite value) the state is unchanged.
  /// `bucket`, if given, is set to the bucket the batch was drawn from.
  llvm::Expected<exec::StepInputs> next(size_t *bucket = nullptr);

  /// The sequence's state: where the next batch is drawn from, or with a
  /// share, the job's at the last step boundary handed out.
  uint64_t state() const { return shareRanks > 1 ? jobState : consumedState; }
  void setState(uint64_t s);
  /// A rank's share of the job's sequence (docs/Distributed.md, "Data"):
  /// of every step's `ranks * perStep` batches, this source hands out the
  /// `perStep` from index `rank * perStep` and jumps over the others', so
  /// what it reads ahead is its own. state() and setState() stay the job's.
  /// Set before the first batch.
  void setShare(int64_t rank, int64_t ranks, int64_t perStep);
  /// The state after `batches` more batches from `state`, found without
  /// making them (the generator jumps): the ranks of a data-parallel job
  /// each take their own batches of one sequence (docs/Distributed.md).
  uint64_t stateAfter(uint64_t state, int64_t batches) const;

  /// Sample `k` (of size()) directly, drawing nothing: validation reads
  /// its samples in order. Not to be mixed with next() on one source.
  /// `conditioning`: InputShapes::conditioningElements() of them.
  llvm::Error sample(size_t k, float *latents, float *conditioning) {
    return readSample(k, latents, conditioning);
  }
  size_t size() const { return numSamples(); }
  /// The samples of each bucket (a source of one shape: one bucket, all
  /// of them), in order.
  const std::vector<std::vector<size_t>> &buckets() const {
    return bucketSamples;
  }

  /// Host bytes this source holds: samples kept in memory and batches
  /// made ahead (what the run's memory check counts).
  uint64_t bytesHeld() const;

  /// What identifies the samples, for a resume to check that they are the
  /// ones the run trained on; empty for a source that has nothing to
  /// check (the synthetic task follows the seed).
  virtual std::string digest() const { return ""; }

protected:
  /// `shapes`: per bucket (docs/Runtime.md, "Buckets"); one for a source
  /// of one shape. A derived source with several sets bucketSamples.
  DataSource(std::vector<InputShapes> shapes, uint64_t seed, int readAhead);
  /// Writes the clean latents [C, T, H, W] and conditioning block (see
  /// InputShapes::conditioningElements) of sample `k`.
  virtual llvm::Error readSample(size_t k, float *latents,
                                 float *conditioning) = 0;
  virtual size_t numSamples() const = 0;
  /// Bytes of samples kept in memory.
  virtual uint64_t bytesKept() const { return 0; }
  /// Stops the read-ahead thread; derived destructors call it first, since
  /// the thread calls their readSample.
  void stopReadAhead();

  InputShapes shapes; ///< of bucket 0
  std::vector<InputShapes> bucketShapes;
  std::vector<std::vector<size_t>> bucketSamples;

private:
  struct Made {
    llvm::Expected<exec::StepInputs> inputs;
    uint64_t stateAfter;
    size_t bucket = 0;
    /// With a share: whether the batch is the last of its step's, and the
    /// job's state after the step.
    bool endsShare = false;
    uint64_t jobStateAfter = 0;
    bool ok =
        true; ///< whether `inputs` holds a batch (read without locking it)
  };
  Made make(uint64_t state);
  /// With a share, counts a batch made into its step (`inStep`) and, at
  /// the share's end, jumps over the other ranks' batches.
  void finishBatch(Made &m, int64_t &inStep) const;
  /// A batch's bucket, the first draw of a batch that has several to pick.
  size_t drawBucket(Random &rng) const;
  void readAheadLoop();

  uint64_t consumedState;
  int64_t shareRank = 0, shareRanks = 1, sharePerStep = 1;
  uint64_t jobState = 0;
  int64_t consumedInStep = 0, producedInStep = 0;
  int readAhead;
  // Read-ahead: batches made from producedState on, in order.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Made> ready;
  uint64_t producedState;
  uint64_t generation = 0; ///< bumped when the sequence is reset
  bool stopping = false;
  std::thread worker;
};

class SyntheticData : public DataSource {
public:
  static constexpr int kPrototypes = 8;
  SyntheticData(const InputShapes &shapes, uint64_t seed);
  ~SyntheticData() override { stopReadAhead(); }

private:
  llvm::Error readSample(size_t k, float *latents,
                         float *conditioning) override;
  size_t numSamples() const override { return latents.size(); }
  uint64_t bytesKept() const override;
  std::vector<std::vector<float>> latents, conditions;
};

/// Samples from files (docs/Runtime.md, "Data files"): every
/// `*.safetensors` in a directory holds one sample, `latents` [C, T, H, W]
/// and `condition` [L, D] (text embeddings; DiT: a one-element class
/// label), and an image-conditioned model's `image_embeds` and
/// `image_condition`, in f32, bf16 or f16. Headers are checked when the
/// directory is opened; tensors are read when a batch needs them (kReadAhead
/// batches ahead), so a dataset of any size costs a few batches of memory, and
/// every value read is checked to be finite.
class FileData : public DataSource {
public:
  static constexpr int kReadAhead = 2;
  static llvm::Expected<std::unique_ptr<FileData>>
  open(llvm::StringRef dir, const InputShapes &shapes, uint64_t seed);
  /// Samples of several shapes (docs/Runtime.md, "Buckets"): bucket b is
  /// named names[b] ("FxHxW") and has shapes[b]. A sample's bucket is its
  /// `megaslide.bucket` metadata, which must agree with its latents'
  /// shape, else the bucket of that shape; a sample in none is an error.
  static llvm::Expected<std::unique_ptr<FileData>>
  open(llvm::StringRef dir, std::vector<InputShapes> shapes,
       llvm::ArrayRef<std::string> names, uint64_t seed);
  ~FileData() override { stopReadAhead(); }

private:
  FileData(std::vector<InputShapes> shapes, uint64_t seed,
           std::vector<std::string> files)
      : DataSource(std::move(shapes), seed, kReadAhead),
        files(std::move(files)), fileBucket(this->files.size(), 0) {}
  llvm::Error readSample(size_t k, float *latents,
                         float *conditioning) override;
  size_t numSamples() const override { return files.size(); }
  llvm::Error checkHeader(const host::SafetensorsReader &reader,
                          size_t bucket) const;
  /// "N samples, xxh3 H": of every file's name, size and header (tensors
  /// and metadata), read when the folder is opened. Copies of the folder
  /// keep it; a sample added, removed, or replaced by one of another size
  /// or header changes it.
  std::string digest() const override;
  void addToDigest(const host::SafetensorsReader &reader);
  std::vector<std::string> files;
  std::string digestText;
  std::vector<size_t> fileBucket; ///< per file
};

} // namespace megaslide::train

#endif // MEGASLIDE_RUNTIME_TRAIN_SYNTHETICDATA_H
