# Text compiled into the libraries: the presets (lib/Model) and the CUDA C++
# of the kernels that the generators emit (lib/Target/Cuda, runtime/cuda),
# and the nvcc check of that CUDA C++.

# megaslide_embed_files(<output> <delimiter> [DEVICE] <files>...)
#
# Writes <output>: one `{"<name>", R"<delimiter>(<text>)<delimiter>"},` line
# per file, in order, for an array initialiser to #include (<name>: the file
# name without its last extension). Written at configure time, and only
# when it changes; CMake configures again when one of the files changes.
#
# DEVICE: the files are CUDA C++ for NVRTC, which compiles one text without
# an include path. Each file loses its header comment (through the first
# `//===---...---===//` line) and its `#include "*.cuh"` lines: the generator
# puts the included files' text, or its own configuration, there.
function(megaslide_embed_files output delimiter)
  cmake_parse_arguments(ARG "DEVICE" "" "" ${ARGN})
  string(REPEAT "-" 70 dashes)
  set(banner "//===${dashes}===//\n")
  set(entries "")
  foreach(file ${ARG_UNPARSED_ARGUMENTS})
    get_filename_component(path ${file} ABSOLUTE)
    get_filename_component(name ${path} NAME_WLE)
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${path})
    file(READ ${path} text)
    if(ARG_DEVICE)
      string(FIND "${text}" "\n${banner}" end)
      string(FIND "${text}" "//===- " start)
      if(NOT start EQUAL 0 OR end EQUAL -1)
        message(FATAL_ERROR "${path}: no header comment ending in a "
          "//===---===// line")
      endif()
      string(LENGTH "\n${banner}" length)
      math(EXPR end "${end} + ${length}")
      string(SUBSTRING "${text}" ${end} -1 text)
      string(REGEX REPLACE "(^|\n)#include \"[^\"\n]*\\.cuh\"\n" "\\1" text
        "${text}")
    endif()
    string(FIND "${text}" ")${delimiter}\"" clash)
    if(NOT clash EQUAL -1)
      message(FATAL_ERROR "${path} holds the raw-string end )${delimiter}\"")
    endif()
    string(APPEND entries
      "{\"${name}\", R\"${delimiter}(${text})${delimiter}\"},\n")
  endforeach()
  get_filename_component(tmp ${output} NAME)
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/${tmp}.tmp "${entries}")
  configure_file(${CMAKE_CURRENT_BINARY_DIR}/${tmp}.tmp ${output} COPYONLY)
endfunction()

# The kernels' CUDA C++ is compiled with nvcc in the build (for sm_90a,
# warnings as errors) where nvcc is found, so that it fails to build rather
# than at NVRTC time on a GPU node.
find_program(MEGASLIDE_NVCC nvcc HINTS ENV CUDA_HOME PATH_SUFFIXES bin
  PATHS /usr/local/cuda/bin)
option(MEGASLIDE_CHECK_DEVICE_CODE
  "Compile the kernels' CUDA C++ with nvcc in the build (where nvcc is found)"
  ON)
if(MEGASLIDE_CHECK_DEVICE_CODE AND NOT MEGASLIDE_NVCC)
  message(STATUS "nvcc not found: the kernels' CUDA C++ is not compiled in "
    "the build (NVRTC still compiles it at run time)")
endif()

# megaslide_check_device_code(<target> <source> [FLAGS <flag>...]
#                             [DEPENDS <file>...])
#
# Adds <target>, which compiles <source> (CUDA C++, .cu or .cuh) with nvcc
# and <flags> into nothing, again when <source> or a file it DEPENDS on
# changes; the target does nothing without nvcc.
function(megaslide_check_device_code target source)
  cmake_parse_arguments(ARG "" "" "FLAGS;DEPENDS" ${ARGN})
  if(NOT MEGASLIDE_CHECK_DEVICE_CODE OR NOT MEGASLIDE_NVCC)
    add_custom_target(${target})
    return()
  endif()
  get_filename_component(path ${source} ABSOLUTE)
  set(stamp ${CMAKE_CURRENT_BINARY_DIR}/${target}.stamp)
  add_custom_command(OUTPUT ${stamp}
    COMMAND ${MEGASLIDE_NVCC} -arch=sm_90a --std=c++17 -Werror all-warnings
      ${ARG_FLAGS} -x cu -c ${path} -o /dev/null
    COMMAND ${CMAKE_COMMAND} -E touch ${stamp}
    DEPENDS ${path} ${ARG_DEPENDS}
    COMMENT "Compiling ${source} with nvcc (sm_90a) ${ARG_FLAGS}"
    VERBATIM)
  add_custom_target(${target} DEPENDS ${stamp})
endfunction()
