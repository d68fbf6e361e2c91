// Validation and dispatch of copy_shards_ and copy_ranges_ (see copy_ranges.h).
//
// One validation serves both: copy_shards_ is checked as copy_ranges_ with one destination
// and one source, and only the way errors name things differs (`Naming`). The checks run
// in a fixed order (the table's form, the tensors, each row in caller order, then the
// overlaps), so the first problem found is the one reported; the pure-PyTorch reference in
// verl/hybrid/range_checks.py follows the same order with the same words, and tests compare
// the two.

#include "copy_ranges.h"

#include "byte_copy.h"

#include <c10/core/GradMode.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace verl {
namespace {

// One row of the range table, in element units (copy_shards_ rows have both indices 0).
struct Row {
  int64_t src_index;
  int64_t src_offset;
  int64_t dst_index;
  int64_t dst_offset;
  int64_t length;
};

// How the errors of one entry point name things: copy_shards_ has one "src" and one "dst",
// copy_ranges_ has lists ("srcs[2]", "dsts[0]") and rows that carry tensor indices.
struct Naming {
  const char* op;
  bool lists;

  int64_t columns() const { return lists ? 5 : 3; }

  const char* column_names() const {
    return lists ? "(src_index, src_offset, dst_index, dst_offset, length)"
                 : "(src_offset, dst_offset, length)";
  }

  // side is "src" or "dst".
  std::string tensor(const char* side, int64_t index) const {
    return lists ? std::string(side) + "s[" + std::to_string(index) + "]" : std::string(side);
  }

  std::string describe(int64_t i, const Row& r) const {
    std::ostringstream out;
    out << "range " << i << " (";
    if (lists) out << "src_index=" << r.src_index << ", ";
    out << "src_offset=" << r.src_offset << ", ";
    if (lists) out << "dst_index=" << r.dst_index << ", ";
    out << "dst_offset=" << r.dst_offset << ", length=" << r.length << ")";
    return out.str();
  }
};

[[noreturn]] void fail(const Naming& naming, const std::string& message) {
  throw std::invalid_argument(std::string(naming.op) + ": " + message);
}

// Python's spelling ("torch.float16"), so that messages match the reference's str(dtype).
std::string dtype_name(at::ScalarType type) {
  return "torch." + std::string(c10::getDtypeNames(type).first);
}

std::string list_of(at::IntArrayRef values) {
  std::ostringstream out;
  out << "[";
  for (size_t d = 0; d < values.size(); ++d) out << (d ? ", " : "") << values[d];
  out << "]";
  return out.str();
}

// Shape and strides as "[a, b] with strides [c, d]" (non-strided layouts have no strides).
std::string geometry(const at::Tensor& t) {
  return list_of(t.sizes()) + " with strides " +
         (t.layout() == at::kStrided ? list_of(t.strides()) : std::string("[]"));
}

// copy_shards_ takes flat tensors only; copy_ranges_ views any contiguous tensor flat.
void check_layout(const Naming& naming, const at::Tensor& t, const std::string& name) {
  const bool strided_contiguous = t.layout() == at::kStrided && t.is_contiguous();
  if (!naming.lists && !(strided_contiguous && t.dim() == 1)) {
    fail(naming, name + " must be a flat (1-D contiguous, strided) tensor, got shape " + geometry(t) +
                     "; view a contiguous buffer as 1-D with .view(-1) (a copy made by .contiguous() "
                     "or .reshape() would not receive the writes)");
  }
  if (naming.lists && !strided_contiguous) {
    fail(naming, name + " must be a contiguous (strided) tensor, got shape " + geometry(t) +
                     "; pass the tensor that owns the memory (a copy made by .contiguous() would "
                     "not receive the writes)");
  }
}

// Checks the table's form and returns its rows on the host. The tensors' device is known
// by then: the table must be on the CPU or on that device.
std::vector<Row> read_rows(const Naming& naming, const at::Tensor& ranges, const c10::Device& device) {
  if (ranges.device() != device && !ranges.device().is_cpu()) {
    std::ostringstream out;
    out << "ranges is on " << ranges.device() << " but the tensors are on " << device
        << "; pass ranges on the cpu";
    if (!device.is_cpu()) out << " or on " << device;
    fail(naming, out.str());
  }
  const at::Tensor host = ranges.cpu().contiguous();
  const int64_t* table = host.const_data_ptr<int64_t>();
  const int64_t count = host.size(0);
  std::vector<Row> rows(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t* r = table + naming.columns() * i;
    rows[i] = naming.lists ? Row{r[0], r[1], r[2], r[3], r[4]} : Row{0, r[0], 0, r[1], r[2]};
  }
  return rows;
}

void check_table_form(const Naming& naming, const at::Tensor& ranges) {
  if (!ranges.defined()) fail(naming, "ranges must be a defined tensor");
  if (ranges.scalar_type() != at::kLong || ranges.dim() != 2 || ranges.size(1) != naming.columns()) {
    fail(naming, "ranges must be an int64 tensor of shape [N, " + std::to_string(naming.columns()) +
                     "] holding " + naming.column_names() + " rows, got dtype " +
                     dtype_name(ranges.scalar_type()) + " and shape " + list_of(ranges.sizes()));
  }
}

// Tensor-level checks: defined, one device, one dtype, layout, a supported device, and no
// destination that autograd would miss the write to. Returns the device.
c10::Device check_tensors(const Naming& naming, const std::vector<at::Tensor>& dsts,
                          const std::vector<at::Tensor>& srcs) {
  // Destinations first, then sources, each in list order.
  std::vector<std::pair<const at::Tensor*, std::string>> all;
  for (size_t k = 0; k < dsts.size(); ++k) all.emplace_back(&dsts[k], naming.tensor("dst", k));
  for (size_t k = 0; k < srcs.size(); ++k) all.emplace_back(&srcs[k], naming.tensor("src", k));
  for (const auto& [t, name] : all) {
    if (!t->defined()) fail(naming, name + " must be a defined tensor");
  }
  if (all.empty()) return c10::Device(c10::kCPU);

  const at::Tensor& first = *all.front().first;
  const std::string& first_name = all.front().second;
  for (const auto& [t, name] : all) {
    if (t->device() != first.device()) {
      std::ostringstream out;
      out << first_name << " is on " << first.device() << " but " << name << " is on " << t->device()
          << "; move every tensor to one device";
      fail(naming, out.str());
    }
    if (t->scalar_type() != first.scalar_type()) {
      fail(naming, first_name + " has dtype " + dtype_name(first.scalar_type()) + " but " + name +
                       " has dtype " + dtype_name(t->scalar_type()) + "; " + naming.op +
                       " does not convert, cast " + name + " first");
    }
  }
  for (const auto& [t, name] : all) check_layout(naming, *t, name);

  const c10::Device device = first.device();
  const bool cuda = device.is_cuda();
  if (!device.is_cpu() && !(cuda && built_with_cuda())) {
    std::ostringstream out;
    out << "tensors on " << device << " are not supported by this build of verl._C "
        << (cuda ? "(built without CUDA: reinstall with a CUDA torch and toolkit present)"
                 : "(supported: cpu, and cuda when built with CUDA)");
    fail(naming, out.str());
  }
  for (size_t k = 0; k < dsts.size(); ++k) {
    if (dsts[k].requires_grad() && c10::GradMode::is_enabled()) {
      const std::string name = naming.tensor("dst", static_cast<int64_t>(k));
      fail(naming, name + " requires grad and grad mode is on; the copy bypasses autograd, so call "
                          "it under torch.no_grad() (or pass " + name + ".detach())");
    }
  }
  return device;
}

// One side of row i: its tensor index within the list, then its span within the tensor.
// The bound is written as `offset > numel - length` so that huge values cannot overflow
// (length >= 0 is checked before the spans).
void check_index(const Naming& naming, int64_t i, const Row& r, const char* side, int64_t index,
                 int64_t count) {
  if (index >= 0 && index < count) return;
  fail(naming, naming.describe(i, r) + " has " + side + "_index out of range; need 0 <= " + side +
                   "_index < len(" + side + "s) = " + std::to_string(count));
}

void check_span(const Naming& naming, int64_t i, const Row& r, const char* side, int64_t index,
                int64_t offset, int64_t numel) {
  if (offset >= 0 && offset <= numel - r.length) return;
  const std::string name = naming.tensor(side, index);
  fail(naming, naming.describe(i, r) + (side[0] == 's' ? " reads" : " writes") + " outside " + name +
                   " (numel " + std::to_string(numel) + "); need 0 <= " + side + "_offset and " + side +
                   "_offset + length <= " + name + ".numel()");
}

// Per-row checks in caller order, so the first bad row is the one reported.
void check_rows(const Naming& naming, const std::vector<at::Tensor>& dsts,
                const std::vector<at::Tensor>& srcs, const std::vector<Row>& rows) {
  for (int64_t i = 0; i < static_cast<int64_t>(rows.size()); ++i) {
    const Row& r = rows[i];
    check_index(naming, i, r, "src", r.src_index, static_cast<int64_t>(srcs.size()));
    check_index(naming, i, r, "dst", r.dst_index, static_cast<int64_t>(dsts.size()));
    if (r.length < 0) fail(naming, naming.describe(i, r) + " has a negative length");
    check_span(naming, i, r, "src", r.src_index, r.src_offset, srcs[r.src_index].numel());
    check_span(naming, i, r, "dst", r.dst_index, r.dst_offset, dsts[r.dst_index].numel());
  }
}

std::string span(const std::string& tensor, int64_t offset, int64_t length) {
  return tensor + "[" + std::to_string(offset) + ":" + std::to_string(offset + length) + "]";
}

// Where each row reads and writes, as raw pointers (valid once check_rows has passed).
struct Addresses {
  std::vector<const char*> src_base;
  std::vector<char*> dst_base;
  int64_t elem;

  const char* read(const Row& r) const { return src_base[r.src_index] + r.src_offset * elem; }
  char* write(const Row& r) const { return dst_base[r.dst_index] + r.dst_offset * elem; }
  uintptr_t read_at(const Row& r) const { return reinterpret_cast<uintptr_t>(read(r)); }
  uintptr_t write_at(const Row& r) const { return reinterpret_cast<uintptr_t>(write(r)); }
  uintptr_t bytes(const Row& r) const { return static_cast<uintptr_t>(r.length * elem); }
};

Addresses addresses_of(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs) {
  Addresses a{{}, {}, dsts.empty() ? 1 : static_cast<int64_t>(dsts.front().element_size())};
  for (const at::Tensor& t : srcs) a.src_base.push_back(static_cast<const char*>(t.const_data_ptr()));
  for (const at::Tensor& t : dsts) a.dst_base.push_back(static_cast<char*>(t.data_ptr()));
  return a;
}

// Writes pairwise disjoint in memory (within one destination, and across destinations that
// share memory). Returns the non-empty rows by write address (ties in caller order).
std::vector<int64_t> check_writes(const Naming& naming, const std::vector<Row>& rows, const Addresses& at) {
  std::vector<int64_t> order;
  for (int64_t i = 0; i < static_cast<int64_t>(rows.size()); ++i) {
    if (rows[i].length > 0) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return at.write_at(rows[a]) < at.write_at(rows[b]); });
  // Disjoint iff neighbours are. Of the overlapping neighbours, report the pair listed first
  // (smallest lower index, then smallest higher one), not the first in address order: where
  // separate allocations lie in memory is arbitrary, and the message must not depend on it.
  int64_t a = -1, b = -1;
  for (size_t k = 0; k + 1 < order.size(); ++k) {
    const Row &left = rows[order[k]], &right = rows[order[k + 1]];
    if (at.write_at(left) + at.bytes(left) <= at.write_at(right)) continue;
    const int64_t lo = std::min(order[k], order[k + 1]), hi = std::max(order[k], order[k + 1]);
    if (a < 0 || lo < a || (lo == a && hi < b)) {
      a = lo;
      b = hi;
    }
  }
  if (a >= 0) {
    const Row &ra = rows[a], &rb = rows[b];
    const std::string da = naming.tensor("dst", ra.dst_index), db = naming.tensor("dst", rb.dst_index);
    const std::string where =
        ra.dst_index == rb.dst_index ? da : "the memory " + da + " and " + db + " share";
    fail(naming, "ranges " + std::to_string(a) + " and " + std::to_string(b) + " overlap in " + where +
                     " (range " + std::to_string(a) + " writes " + span(da, ra.dst_offset, ra.length) +
                     ", range " + std::to_string(b) + " writes " + span(db, rb.dst_offset, rb.length) +
                     "); " +
                     (naming.lists ? "destination ranges must be disjoint in memory"
                                   : "dst ranges must be disjoint"));
  }
  return order;
}

// No read of a written byte: the copies run in parallel and in no fixed order. `order` is
// check_writes' result, so the written spans are disjoint and their ends ascend.
void check_reads(const Naming& naming, const std::vector<Row>& rows, const Addresses& at,
                 const std::vector<int64_t>& order) {
  std::vector<uintptr_t> write_end(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    write_end[k] = at.write_at(rows[order[k]]) + at.bytes(rows[order[k]]);
  }
  for (int64_t i = 0; i < static_cast<int64_t>(rows.size()); ++i) {
    const Row& r = rows[i];
    if (r.length == 0) continue;
    const uintptr_t begin = at.read_at(r), end = begin + at.bytes(r);
    // First written span that ends after this read begins: the only candidate overlap.
    const size_t k = std::upper_bound(write_end.begin(), write_end.end(), begin) - write_end.begin();
    if (k == order.size() || at.write_at(rows[order[k]]) >= end) continue;
    const Row& w = rows[order[k]];
    fail(naming, "range " + std::to_string(i) + " reads " +
                     span(naming.tensor("src", r.src_index), r.src_offset, r.length) +
                     ", which shares memory with " +
                     span(naming.tensor("dst", w.dst_index), w.dst_offset, w.length) + " written by range " +
                     std::to_string(order[k]) +
                     (naming.lists ? "; when sources and destinations share memory, no range may read what "
                                     "any range writes (copy the source to a separate buffer first)"
                                   : "; when src and dst view one buffer, no range may read what another "
                                     "writes (copy src to a separate buffer first)"));
  }
}

// The overlap checks, on byte addresses so that tensors sharing memory (one tensor in both
// lists, views of one buffer) are covered. Returns the work items, in caller order.
std::vector<CopyItem> check_overlaps(const Naming& naming, const std::vector<at::Tensor>& dsts,
                                     const std::vector<at::Tensor>& srcs, const std::vector<Row>& rows) {
  const Addresses at = addresses_of(dsts, srcs);
  const std::vector<int64_t> order = check_writes(naming, rows, at);
  check_reads(naming, rows, at, order);
  std::vector<CopyItem> items;
  items.reserve(order.size());
  for (const Row& r : rows) {
    if (r.length > 0) items.push_back(CopyItem{at.read(r), at.write(r), r.length * at.elem});
  }
  return items;
}

// Every check, then the copy: nothing is written unless all checks pass.
void check_and_copy(const Naming& naming, const std::vector<at::Tensor>& dsts,
                    const std::vector<at::Tensor>& srcs, const at::Tensor& ranges) {
  check_table_form(naming, ranges);
  const c10::Device device = check_tensors(naming, dsts, srcs);
  const std::vector<Row> rows = read_rows(naming, ranges, device);
  check_rows(naming, dsts, srcs, rows);
  copy_items(device, check_overlaps(naming, dsts, srcs, rows));
}

}  // namespace

at::Tensor copy_shards_(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& ranges) {
  check_and_copy(Naming{"copy_shards_", false}, {dst}, {src}, ranges);
  return dst;
}

void copy_ranges_(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs,
                  const at::Tensor& ranges) {
  check_and_copy(Naming{"copy_ranges_", true}, dsts, srcs, ranges);
}

}  // namespace verl
