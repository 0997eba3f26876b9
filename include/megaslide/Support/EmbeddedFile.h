//===- EmbeddedFile.h - A file compiled into a library as text --*- C++ -*-===//
//
// The element of the tables that megaslide_embed_files
// (cmake/MegaSlideEmbed.cmake) writes for an array initialiser to
// #include: the presets of lib/Model and the kernels' CUDA C++.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_SUPPORT_EMBEDDEDFILE_H
#define MEGASLIDE_SUPPORT_EMBEDDEDFILE_H

namespace megaslide {

/// One file of such a table.
struct EmbeddedFile {
  const char *name; ///< the file name without its last extension
  const char *text; ///< its text (device code: as NVRTC is to see it)
};

} // namespace megaslide

#endif // MEGASLIDE_SUPPORT_EMBEDDEDFILE_H
