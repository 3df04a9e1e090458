# Shared CMake pieces of magi's native extensions (pybind11 modules, optional CUDA).
#
#   magi_enable_cuda()            -> MAGI_WITH_CUDA ON when a CUDA compiler exists (and
#                                    MAGI_ENABLE_CUDA is not OFF) and can build at least one of
#                                    MAGI_CUDA_ARCHS ("auto": 80;90a-real;100, see MagiCudaArchs.cmake)
#   magi_add_module(NAME SRC...)  -> a pybind11 module; .cu sources only when MAGI_WITH_CUDA. With
#                                    CUDA it defines MAGI_CUDA_ARCHS_STR ("80,90a-real,100"), which
#                                    the module exports so Python can check the GPU at run time.
#
# Modules take raw pointers and stream handles from Python, so they link neither libtorch nor
# libcuda (cudart is linked statically): one build works with any torch.

include_guard(GLOBAL)
include(CheckLanguage)
include(MagiCudaArchs)

option(MAGI_ENABLE_CUDA "Build CUDA kernels when a CUDA compiler is available" ON)
set(MAGI_CUDA_ARCHS "auto" CACHE STRING
    "CUDA architectures for magi kernels: 'auto' (those of ${MAGI_DEFAULT_CUDA_ARCHS} the compiler supports) or a CUDA_ARCHITECTURES list")

macro(magi_enable_cuda)
  set(MAGI_WITH_CUDA OFF)
  if(MAGI_ENABLE_CUDA)
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      # an explicit list passes through the same check, so an arch this nvcc lacks is dropped
      # with a message instead of failing the whole native build
      if(MAGI_CUDA_ARCHS STREQUAL "auto")
        magi_select_cuda_archs("${CMAKE_CUDA_COMPILER}" magi_archs)
      else()
        magi_select_cuda_archs("${CMAKE_CUDA_COMPILER}" magi_archs WANTED ${MAGI_CUDA_ARCHS})
      endif()
    endif()
    if(CMAKE_CUDA_COMPILER AND magi_archs)
      set(CMAKE_CUDA_ARCHITECTURES ${magi_archs})
      enable_language(CUDA)
      find_package(CUDAToolkit REQUIRED)
      set(MAGI_WITH_CUDA ON)
      message(STATUS "magi: CUDA compiler ${CMAKE_CUDA_COMPILER} (${CMAKE_CUDA_COMPILER_VERSION}), archs ${magi_archs}")
    elseif(CMAKE_CUDA_COMPILER)
      message(STATUS "magi: no CUDA architecture left to build, building the CPU part only")
    else()
      message(STATUS "magi: no CUDA compiler found, building the CPU part only")
    endif()
  endif()
endmacro()

function(magi_add_module name)
  set(cpu_sources "")
  set(cuda_sources "")
  foreach(src IN LISTS ARGN)
    if(src MATCHES "\\.cu$")
      list(APPEND cuda_sources ${src})
    else()
      list(APPEND cpu_sources ${src})
    endif()
  endforeach()
  if(MAGI_WITH_CUDA)
    pybind11_add_module(${name} MODULE ${cpu_sources} ${cuda_sources})
    string(REPLACE ";" "," archs_str "${CMAKE_CUDA_ARCHITECTURES}")
    target_compile_definitions(${name} PRIVATE MAGI_WITH_CUDA=1 MAGI_CUDA_ARCHS_STR="${archs_str}")
    target_link_libraries(${name} PRIVATE CUDA::cudart_static)
    set_target_properties(${name} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
  else()
    pybind11_add_module(${name} MODULE ${cpu_sources})
  endif()
  target_compile_features(${name} PRIVATE cxx_std_17)
endfunction()
