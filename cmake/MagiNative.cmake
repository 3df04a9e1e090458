# Shared CMake pieces of magi's native extensions (pybind11 modules, optional CUDA).
#
#   magi_enable_cuda()            -> MAGI_WITH_CUDA ON when a CUDA compiler exists (and
#                                    MAGI_ENABLE_CUDA is not OFF); arch from MAGI_CUDA_ARCHS (90a)
#   magi_add_module(NAME SRC...)  -> a pybind11 module; .cu sources only when MAGI_WITH_CUDA
#
# Modules take raw pointers and stream handles from Python, so they link neither libtorch nor
# libcuda (cudart is linked statically): one build works with any torch.

include_guard(GLOBAL)
include(CheckLanguage)

option(MAGI_ENABLE_CUDA "Build CUDA kernels when a CUDA compiler is available" ON)
set(MAGI_CUDA_ARCHS "90a" CACHE STRING "CUDA architectures for magi kernels (Hopper: 90a)")

macro(magi_enable_cuda)
  set(MAGI_WITH_CUDA OFF)
  if(MAGI_ENABLE_CUDA)
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      set(CMAKE_CUDA_ARCHITECTURES ${MAGI_CUDA_ARCHS})
      enable_language(CUDA)
      find_package(CUDAToolkit REQUIRED)
      set(MAGI_WITH_CUDA ON)
      message(STATUS "magi: CUDA compiler ${CMAKE_CUDA_COMPILER} (${CMAKE_CUDA_COMPILER_VERSION}), archs ${MAGI_CUDA_ARCHS}")
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
    target_compile_definitions(${name} PRIVATE MAGI_WITH_CUDA=1)
    target_link_libraries(${name} PRIVATE CUDA::cudart_static)
    set_target_properties(${name} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
  else()
    pybind11_add_module(${name} MODULE ${cpu_sources})
  endif()
  target_compile_features(${name} PRIVATE cxx_std_17)
endfunction()
