#include "model/sequence_cache.h"

namespace dsv4 {

const char* to_string(CacheStream s) {
  switch (s) {
    case CacheStream::window:
      return "window";
    case CacheStream::compressed:
      return "compressed";
    case CacheStream::indexer_keys:
      return "indexer_keys";
  }
  return "?";
}

}  // namespace dsv4
