#include "model/mapped_file.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "model/error.h"

namespace dsv4 {

std::unique_ptr<MappedFile> MappedFile::open(const std::string& path, bool populate) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw InputError(fmt::format("{}: cannot stat: {}", path, std::strerror(e)));
  }
  std::unique_ptr<MappedFile> m(new MappedFile());
  m->path_ = path;
  m->size_ = size_t(st.st_size);
  if (m->size_ == 0) {
    ::close(fd);
    return m;
  }
  void* p = mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE | (populate ? MAP_POPULATE : 0), fd, 0);
  const int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) throw InputError(fmt::format("{}: cannot map: {}", path, std::strerror(e)));
  if (populate) madvise(p, m->size_, MADV_SEQUENTIAL);
  m->data_ = static_cast<const uint8_t*>(p);
  return m;
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace dsv4
