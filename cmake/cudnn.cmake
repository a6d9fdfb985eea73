# cuDNN fused attention (src/cuda/attention/attention_cudnn.cu; docs/cuda.md,
# "Attention on the GPU"): a second implementation of the causal attention next
# to the flash kernels, built when CUDA is on and both of these are found:
#
#  * cuDNN 9 (cudnn.h, libcudnn.so / libcudnn.so.9) in CUDNN_ROOT (CMake or
#    environment variable), CUDNN_HOME, the Python package nvidia-cudnn-cu*
#    (`import nvidia.cudnn`, which torch wheels install), the CUDA toolkit, or
#    the system paths;
#  * the header-only cudnn-frontend (cudnn_frontend.h) in
#    CUDNN_FRONTEND_INCLUDE_DIR (CMake or environment variable), the include/
#    directory next to Python's site-packages entries and PYTHONPATH entries
#    (where the PyPI wheel nvidia-cudnn-frontend puts it), or a wheel
#    downloaded into the source tree's .whl/ directory
#    (`pip download --no-deps -d .whl nvidia-cudnn-frontend==1.32.0`), whose
#    include/ is unpacked into the build directory (_cudnn_frontend/).
#
# Sets LONGMOE_HAVE_CUDNN, CUDNN_INCLUDE_DIR, CUDNN_LIBRARY,
# CUDNN_FRONTEND_INCLUDE_DIR and, when OFF, LONGMOE_CUDNN_WHY.
option(LONGMOE_CUDNN "Build the cuDNN attention when CUDA is on and cuDNN + cudnn-frontend are found" ON)
set(CUDNN_ROOT "" CACHE PATH "Where cuDNN is installed (include/cudnn.h, lib/libcudnn.so)")
set(LONGMOE_HAVE_CUDNN OFF)
set(LONGMOE_CUDNN_WHY "")
if(NOT LONGMOE_CUDNN)
  set(LONGMOE_CUDNN_WHY "LONGMOE_CUDNN=OFF")
else()
  find_package(Python3 COMPONENTS Interpreter QUIET)
  set(_cudnn_hints ${CUDNN_ROOT} $ENV{CUDNN_ROOT} $ENV{CUDNN_HOME})
  set(_py_dirs "")
  if(Python3_Interpreter_FOUND)
    # the pip wheel's directory (a namespace package: no __file__)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import nvidia.cudnn; print(list(nvidia.cudnn.__path__)[0])"
                    OUTPUT_VARIABLE _cudnn_py_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
                    RESULT_VARIABLE _cudnn_py_rc)
    if(_cudnn_py_rc EQUAL 0 AND _cudnn_py_dir)
      list(APPEND _cudnn_hints ${_cudnn_py_dir})
    endif()
    # site-packages directories (the frontend wheel installs <site-packages>/include/cudnn_frontend.h)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c
                    "import site, sysconfig; d = site.getsitepackages() + [site.getusersitepackages(), sysconfig.get_paths()['purelib']]; print(';'.join(d))"
                    OUTPUT_VARIABLE _py_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  list(APPEND _cudnn_hints ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR} /usr/local/cuda /usr)
  find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${_cudnn_hints} ${CUDAToolkit_INCLUDE_DIRS}
            PATH_SUFFIXES include include/x86_64-linux-gnu include/aarch64-linux-gnu)
  # the pip wheel ships libcudnn.so.9 without the libcudnn.so link
  find_library(CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 HINTS ${_cudnn_hints} ${CUDAToolkit_LIBRARY_DIR}
               PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu)

  set(CUDNN_FRONTEND_INCLUDE_DIR "$ENV{CUDNN_FRONTEND_INCLUDE_DIR}" CACHE PATH
      "Where cudnn_frontend.h is (the include/ directory of the nvidia-cudnn-frontend wheel)")
  set(_fe_hints "")
  if(CUDNN_FRONTEND_INCLUDE_DIR)
    list(APPEND _fe_hints ${CUDNN_FRONTEND_INCLUDE_DIR})
  endif()
  string(REPLACE ":" ";" _pythonpath "$ENV{PYTHONPATH}")
  foreach(_d ${_pythonpath} ${_py_dirs})
    if(_d)
      list(APPEND _fe_hints ${_d}/include)
    endif()
  endforeach()
  # a wheel downloaded into .whl/: unpack its include/ once into the build directory
  file(GLOB _fe_wheels ${PROJECT_SOURCE_DIR}/.whl/nvidia_cudnn_frontend-*.whl)
  if(_fe_wheels)
    list(SORT _fe_wheels)
    list(GET _fe_wheels -1 _fe_wheel)
    set(_fe_unpacked ${CMAKE_BINARY_DIR}/_cudnn_frontend)
    if(NOT EXISTS ${_fe_unpacked}/include/cudnn_frontend.h)
      file(ARCHIVE_EXTRACT INPUT ${_fe_wheel} DESTINATION ${_fe_unpacked} PATTERNS "include/*")
    endif()
    list(APPEND _fe_hints ${_fe_unpacked}/include)
  endif()
  unset(_cudnn_frontend_h CACHE)
  find_path(_cudnn_frontend_h cudnn_frontend.h HINTS ${_fe_hints} NO_DEFAULT_PATH)
  if(NOT _cudnn_frontend_h)
    find_path(_cudnn_frontend_h cudnn_frontend.h)
  endif()

  if(NOT CUDNN_INCLUDE_DIR OR NOT CUDNN_LIBRARY)
    set(LONGMOE_CUDNN_WHY "cudnn.h or libcudnn not found: set CUDNN_ROOT")
  elseif(NOT _cudnn_frontend_h)
    set(LONGMOE_CUDNN_WHY "cudnn_frontend.h not found: pip install nvidia-cudnn-frontend, or set CUDNN_FRONTEND_INCLUDE_DIR")
  else()
    file(STRINGS ${CUDNN_INCLUDE_DIR}/cudnn_version.h _cudnn_major REGEX "#define CUDNN_MAJOR +[0-9]+")
    string(REGEX MATCH "[0-9]+" _cudnn_major "${_cudnn_major}")
    if(_cudnn_major AND _cudnn_major LESS 9)
      set(LONGMOE_CUDNN_WHY "cuDNN ${_cudnn_major} found, 9 or later needed")
    else()
      set(LONGMOE_HAVE_CUDNN ON)
      set(CUDNN_FRONTEND_INCLUDE_DIR ${_cudnn_frontend_h} CACHE PATH
          "Where cudnn_frontend.h is (the include/ directory of the nvidia-cudnn-frontend wheel)" FORCE)
    endif()
  endif()
endif()
